"""data.chat_template = "jinja": the folder's own template renders the token ids transformers'
apply_chat_template gives, with the loss on exactly the assistant tokens (its generation
markers, or the render-twice rule where the template has none)."""

from __future__ import annotations

import pytest

from titan_draft.data.chat.format import resolve_chat_format
from titan_draft.data.chat.prompts import render_prompt
from titan_draft.data.chat.template import Turn, render_chat

transformers = pytest.importorskip("transformers")

DEFAULT_SYSTEM = "You are a tiny test model."
# a non-ChatML family's shape: its own turn markers, a default system prompt, answers marked
MARKED = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{%- else %}{% set sys = '" + DEFAULT_SYSTEM + "' %}{% set rest = messages %}{% endif %}"
    "<<SYS>> {{ sys }} <</SYS>>\n"
    "{%- for m in rest %}"
    "{%- if m['role'] == 'assistant' %}[ASSISTANT] {% generation %}{{ m['content'] | trim }}<|im_end|>"
    "{% endgeneration %}\n"
    "{%- else %}[USER] {{ m['content'] | trim }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
UNMARKED = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# renders earlier answers differently from the last one: no prefix rule can find the spans
UNMARKABLE = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[past answer]\n"
              "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}")

CORPUS = [
    [Turn("user", "Hi there"), Turn("assistant", "Hello! How can I help?")],
    [Turn("system", "Be brief."), Turn("user", "2+2?"), Turn("assistant", "4")],
    [Turn("user", "Tell me a story "), Turn("assistant", " Once upon a time…\nThe end. "),
     Turn("user", "Another, in Japanese"), Turn("assistant", "昔々、ある所に。"),
     Turn("user", "Thanks"), Turn("assistant", "You're welcome.")],
    [Turn("system", "Système: réponds en français."), Turn("user", "Ça va ?"), Turn("assistant", "Oui, très bien.")],
]


def _tokenizers(folder, source: str):
    """Our tokenizer with ``source`` as its template and transformers' reading of the same folder:
    the Qwen BPE cut to its first 8000 ranks (written and read in a fraction of the time), with
    ChatML's special tokens."""
    import tiktoken

    from titan_draft.data.tokenizer import Tokenizer, build_tokenizer
    from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer

    qwen = build_tokenizer("qwen3").encoding
    enc = tiktoken.Encoding(name="jinja-test", pat_str=qwen._pat_str,
                            mergeable_ranks={b: r for b, r in qwen._mergeable_ranks.items() if r < 8000},
                            special_tokens={"<|endoftext|>": 8000, "<|im_start|>": 8001, "<|im_end|>": 8002})
    ours = Tokenizer("jinja-test", enc, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                     bos_token="<|endoftext|>", chat_template=source)
    save_hf_tokenizer(ours, str(folder))
    return build_tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(str(folder))


def _hf(hf_tok, turns):
    messages = [{"role": t.role, "content": t.content} for t in turns]
    out = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def test_marked_template_equals_apply_chat_template(tmp_path):
    tok, hf_tok = _tokenizers(tmp_path, MARKED)
    assert tok.chat_template == MARKED
    chat = resolve_chat_format(tok, template="jinja", system_prompt="auto")
    assert chat.system_prompt == ""  # 'auto': the template writes its own default
    assert chat.special_tokens == ("<|im_end|>",)  # what the template spells out: never a mask token
    for turns in CORPUS:
        ids, mask = render_chat(turns, tok, "jinja", chat.system_prompt)
        want_ids, want_mask = _hf(hf_tok, turns)
        assert ids == want_ids
        assert mask == want_mask and any(mask)
        text = tok.decode(ids)
        assert (DEFAULT_SYSTEM in text) == (turns[0].role != "system")


def test_unmarked_template_masks_what_the_markers_mark(tmp_path):
    """Without markers the render-twice rule finds the same spans (the text is the same)."""
    tok, hf_tok = _tokenizers(tmp_path / "unmarked", UNMARKED)
    marked, _ = _tokenizers(tmp_path / "marked", MARKED)
    for turns in CORPUS:
        ids, mask = render_chat(turns, tok, "jinja")
        assert ids == _hf(hf_tok, turns)[0]
        assert (ids, mask) == render_chat(turns, marked, "jinja")
        ids, last = render_chat(turns, tok, "jinja", last_turn_only=True)
        assert sum(last) < sum(mask) or sum(t.role == "assistant" for t in turns) == 1
    # an explicit system prompt replaces the template's default
    ids, _ = render_chat(CORPUS[0], tok, "jinja", "Custom system.")
    assert "Custom system." in tok.decode(ids) and DEFAULT_SYSTEM not in tok.decode(ids)


def test_prompt_ends_with_the_generation_prompt(tmp_path):
    tok, hf_tok = _tokenizers(tmp_path, UNMARKED)
    turns = [Turn("user", "Hi there")]
    want = hf_tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=True,
                                      add_generation_prompt=True, return_dict=True)["input_ids"]
    assert render_prompt(turns, tok, "jinja") == list(want)


def test_template_that_cannot_mark_answers_is_refused_with_one_line(tmp_path):
    tok, _ = _tokenizers(tmp_path, UNMARKABLE)
    with pytest.raises(ValueError, match="cannot mark assistant spans") as e:
        render_chat(CORPUS[2], tok, "jinja")
    assert "\n" not in str(e.value)


def test_auto_picks_the_folder_template_only_without_a_builtin_format(tmp_path):
    """With ChatML's tokens 'auto' keeps the proven built-in format; without them, the folder's."""
    import tiktoken

    from titan_draft.data.tokenizer import Tokenizer

    tok, _ = _tokenizers(tmp_path, MARKED)
    assert resolve_chat_format(tok, template="auto", system_prompt="auto").template == "chatml"
    enc = tok.encoding
    bare = Tokenizer("bare", tiktoken.Encoding(name="bare", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                                               special_tokens={"<|endoftext|>": 8000, "<|im_end|>": 8002}),
                     pad_token="<|endoftext|>", eos_token="<|im_end|>", chat_template=MARKED)
    assert resolve_chat_format(bare, template="auto", system_prompt="auto").template == "jinja"
