"""Chat formats (chatml, qwen3, llama3) rendered in code, and the assistant loss mask.

Expected strings are written by hand from the official templates (Qwen3-8B's
tokenizer_config.json chat_template, Meta-Llama-3-8B-Instruct's); the masks are checked as the
exact list of trained text runs.
"""

import pytest
import tiktoken

from titan_draft.data.chat.template import Turn, check_template, render_chat
from titan_draft.data.tokenizer import Tokenizer

IM_START, IM_END, NL = 151644, 151645, 198
THINK, END_THINK = 151667, 151668

_LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
)  # fmt: skip


@pytest.fixture(scope="module")
def llama_tok(tok):
    """Qwen's BPE with Llama-3's special tokens: enough to test the Llama-3 format and mask."""
    ranks = tok.encoding._mergeable_ranks
    specials = {name: len(ranks) + i for i, name in enumerate(_LLAMA3_SPECIALS)}
    enc = tiktoken.Encoding(
        name="llama3-test", pat_str=tok.encoding._pat_str, mergeable_ranks=ranks,
        special_tokens=specials,
    )  # fmt: skip
    # Llama-3's HF tokenizer has no normalizer.
    return Tokenizer("llama3-test", enc, pad_token="<|end_of_text|>", normalizer=None)


def _render(tok, turns, **kw):
    """(rendered text, trained runs): each run is the decoded text of consecutive masked tokens."""
    ids, mask = render_chat(turns, tok, **kw)
    assert len(ids) == len(mask)
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(tok.decode(run))
            run = []
    if run:
        runs.append(tok.decode(run))
    return tok.decode(ids), runs


# ------------------------------------------------------------------------------------------
# chatml


def test_chatml_literal_ids(tok):
    ids, mask = render_chat([("user", "Hi"), ("assistant", "Hello!")], tok)
    assert ids == [IM_START, 872, NL, 13048, IM_END, NL, IM_START, 77091, NL, 9707, 0, IM_END, NL]
    assert mask == [False] * 9 + [True, True, True, False]


def test_chatml_multi_turn_system_non_ascii(tok):
    turns = [
        ("system", "You are a helpful assistant."),
        ("user", "What is 2+2?"),
        ("assistant", "2+2 equals 4."),
        ("user", "And 3+3? Answer in one word, please."),
        ("assistant", "Six. 日本語 works too 😀!"),
    ]
    text, runs = _render(tok, turns, template="chatml")
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n2+2 equals 4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3? Answer in one word, please.<|im_end|>\n"
        "<|im_start|>assistant\nSix. 日本語 works too 😀!<|im_end|>\n"
    )
    assert runs == ["2+2 equals 4.<|im_end|>", "Six. 日本語 works too 😀!<|im_end|>"]
    # One tokenize call equals the piecewise encoding (special tokens split pre-tokenization).
    assert render_chat(turns, tok)[0] == tok.encode(text)


def test_spans_follow_the_tokenizer_normalizer(tok, llama_tok):
    # Qwen NFC-normalizes (the composed "é" is one character); Llama-3 keeps the combining accent.
    turns = [("user", "cafe\u0301?"), ("assistant", "cafe\u0301 noir")]
    text, runs = _render(tok, turns)
    assert runs == ["caf\u00e9 noir<|im_end|>"] and "\u0301" not in text
    text, runs = _render(llama_tok, turns, template="llama3")
    assert runs == ["cafe\u0301 noir<|eot_id|>"] and text.count("\u0301") == 2


def test_system_prompt(tok):
    turns = [("user", "Hi"), ("assistant", "Hello!")]
    text, runs = _render(tok, turns, system_prompt="Be brief.")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert runs == ["Hello!<|im_end|>"]
    # A conversation with its own system turn keeps it and gets no second one.
    text, _ = _render(tok, [("system", "Own."), *turns], system_prompt="Be brief.")
    assert text.count("<|im_start|>system") == 1 and "Own." in text and "brief" not in text
    assert _render(tok, turns, system_prompt="")[0].startswith("<|im_start|>user")


def test_chatml_inline_reasoning(tok):
    # No reasoning channel: a separate reasoning field is written before the answer, trained.
    text, runs = _render(tok, [Turn("user", "q"), Turn("assistant", "A.", "\nthink\n")])
    assert text.endswith("<|im_start|>assistant\n<think>\nthink\n</think>\n\nA.<|im_end|>\n")
    assert runs == ["<think>\nthink\n</think>\n\nA.<|im_end|>"]


def test_leading_newlines_merge_into_header(tok):
    # "\n" + "\n\n" pre-tokenize as one token that starts in the header: not trained on.
    ids, mask = render_chat([("user", "Hi"), ("assistant", "\n\nGood.")], tok)
    header_end = ids.index(77091) + 1
    assert ids[header_end] == tok.encode("\n\n\n")[0]
    assert mask[header_end] is False
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Good.<|im_end|>"


# ------------------------------------------------------------------------------------------
# qwen3

_HISTORY = [
    Turn("system", "Be exact."),
    Turn("user", "2+2?"),
    Turn("assistant", "<think>\nadd them\n</think>\n\n4."),  # inline reasoning, in history
    Turn("user", "3+3?"),
    Turn("assistant", "6.", reasoning="add again"),  # separate reasoning, in history
    Turn("user", "Capital of France?"),
]
_PROMPT = (
    "<|im_start|>system\nBe exact.<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4.<|im_end|>\n"  # history: reasoning dropped
    "<|im_start|>user\n3+3?<|im_end|>\n"
    "<|im_start|>assistant\n6.<|im_end|>\n"
    "<|im_start|>user\nCapital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.mark.parametrize("last", [
    Turn("assistant", "Paris.", reasoning="\nIt is Paris.\n"),
    Turn("assistant", "<think>\n\nIt is Paris.\n</think>\n\n\nParis."),
])  # fmt: skip
def test_qwen3_thinking_last_turn_with_reasoning(tok, last):
    text, runs = _render(tok, [*_HISTORY, last], template="qwen3", enable_thinking=True)
    assert text == _PROMPT + "<think>\nIt is Paris.\n</think>\n\nParis.<|im_end|>\n"
    # The model writes the think block itself: trained, from <think> on.
    assert runs == [
        "4.<|im_end|>", "6.<|im_end|>", "<think>\nIt is Paris.\n</think>\n\nParis.<|im_end|>"
    ]  # fmt: skip


def test_qwen3_thinking_last_turn_without_reasoning(tok):
    text, runs = _render(tok, [*_HISTORY, ("assistant", "Paris.")], template="qwen3")
    assert text == _PROMPT + "<think>\n\n</think>\n\nParis.<|im_end|>\n"
    assert runs[-1] == "<think>\n\n</think>\n\nParis.<|im_end|>"


@pytest.mark.parametrize("last", [
    Turn("assistant", "Paris.", reasoning="It is Paris."),
    Turn("assistant", "<think>It is Paris.</think>Paris."),
    Turn("assistant", "Paris."),
])  # fmt: skip
def test_qwen3_non_thinking(tok, last):
    turns = [*_HISTORY, last]
    ids, mask = render_chat(turns, tok, "qwen3", enable_thinking=False)
    text, runs = _render(tok, turns, template="qwen3", enable_thinking=False)
    # Reasoning dropped; the empty block is the end of the server's non-thinking prompt.
    assert text == _PROMPT + "<think>\n\n</think>\n\nParis.<|im_end|>\n"
    assert runs == ["4.<|im_end|>", "6.<|im_end|>", "Paris.<|im_end|>"]
    last_think = len(ids) - 1 - ids[::-1].index(THINK)
    assert ids[last_think:last_think + 4] == [THINK, 271, END_THINK, 271]  # "\n\n" tokens
    assert not any(mask[last_think:last_think + 4])


def test_qwen3_trained_span_starts_after_the_generation_prompt(tok):
    # The untrained prefix of the last turn is exactly what the server sends as the prompt
    # (add_generation_prompt=True): "<|im_start|>assistant\n", plus the empty think block with
    # enable_thinking=False.
    turns = [("user", "Hi"), ("assistant", "Hello.")]
    for thinking, prompt in ((True, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
                             (False, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                     "<think>\n\n</think>\n\n")):  # fmt: skip
        ids, mask = render_chat(turns, tok, "qwen3", enable_thinking=thinking)
        assert tok.decode(ids[: mask.index(True)]) == prompt


def test_qwen3_template_details(tok):
    # Only assistant turns after the last user query get a think block; a separate reasoning
    # field, even empty, is not searched for </think>; user text is never stripped.
    turns = [
        Turn("user", " q1 "),
        Turn("assistant", "<think>kept</think>a1", reasoning=""),
    ]
    text, runs = _render(tok, turns, template="qwen3")
    assert text == ("<|im_start|>user\n q1 <|im_end|>\n<|im_start|>assistant\n"
                    "<think>\n\n</think>\n\n<think>kept</think>a1<|im_end|>\n")  # fmt: skip
    assert runs == ["<think>\n\n</think>\n\n<think>kept</think>a1<|im_end|>"]
    # Text after the last </think> is the answer; text before the first (after its last
    # <think>) is the reasoning.
    text, _ = _render(tok, [("user", "q"), ("assistant", "<think>x<think>r</think>y</think>\nz")],
                      template="qwen3")  # fmt: skip
    assert text.endswith("<|im_start|>assistant\n<think>\nr\n</think>\n\nz<|im_end|>\n")


def test_qwen3_tool_response_is_not_a_query(tok):
    # A user turn that is a tool response does not move the last query: the answer before it
    # stays after the last query, keeps its reasoning and is rendered with its think block.
    turns = [Turn("user", "q"), Turn("assistant", "a1", reasoning="r1"),
             Turn("user", "<tool_response>x</tool_response>"), Turn("assistant", "a2")]  # fmt: skip
    text, runs = _render(tok, turns, template="qwen3")
    assert "<|im_start|>assistant\n<think>\nr1\n</think>\n\na1<|im_end|>" in text
    assert runs[0] == "<think>\nr1\n</think>\n\na1<|im_end|>"


# ------------------------------------------------------------------------------------------
# llama3


def test_llama3_multi_turn(llama_tok):
    turns = [("user", "  Hi there\n"), ("assistant", "\nHello! 日本語 😀  "), ("user", "Bye"),
             ("assistant", "Bye.")]  # fmt: skip
    text, runs = _render(llama_tok, turns, template="llama3", system_prompt="Be kind.")
    assert text == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! 日本語 😀<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>"
    )
    assert runs == ["Hello! 日本語 😀<|eot_id|>", "Bye.<|eot_id|>"]
    # The "\n\n" after the header is its own token, so the trained run starts at the content.
    ids, mask = render_chat(turns, llama_tok, "llama3")
    first = mask.index(True)
    assert llama_tok.decode(ids[first - 2 : first]) == "<|end_header_id|>\n\n"


def test_llama3_inline_reasoning(llama_tok):
    text, runs = _render(llama_tok, [Turn("user", "q"), Turn("assistant", "A.", "r")],
                         template="llama3")  # fmt: skip
    assert runs == ["<think>\nr\n</think>\n\nA.<|eot_id|>"]


# ------------------------------------------------------------------------------------------
# every format


_CASES = [("chatml", True), ("qwen3", True), ("qwen3", False), ("llama3", True)]


@pytest.mark.parametrize("template, thinking", _CASES)
def test_last_turn_only(tok, llama_tok, template, thinking):
    t = llama_tok if template == "llama3" else tok
    turns = [Turn("user", "q1"), Turn("assistant", "a1", "r1"), Turn("user", "q2"),
             Turn("assistant", "a2", "r2")]  # fmt: skip
    _, every = _render(t, turns, template=template, enable_thinking=thinking)
    text, last = _render(t, turns, template=template, enable_thinking=thinking, last_turn_only=True)
    assert len(every) == 2 and last == every[1:]
    assert last[0].startswith("<think>\nr2") == (template != "qwen3" or thinking)
    # Nothing else changes: the same ids, only the earlier turns' mask is off.
    assert text == _render(t, turns, template=template, enable_thinking=thinking)[0]
    assert _render(t, turns[:1], template=template, last_turn_only=True)[1] == []


@pytest.mark.parametrize("template, thinking", _CASES)
def test_no_header_token_is_trained(tok, llama_tok, template, thinking):
    t = llama_tok if template == "llama3" else tok
    turns = [("system", "s"), ("user", "user system assistant"), ("assistant", "assistant user"),
             ("user", "q"), ("assistant", "<think>r</think>x")]  # fmt: skip
    ids, mask = render_chat(turns, t, template, enable_thinking=thinking)
    headers = {"<|im_start|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"}
    header_ids = {t.token_id(h) for h in headers if h in t.encoding.special_tokens_set}
    assert header_ids and not header_ids & {i for i, m in zip(ids, mask) if m}
    # Every role name the headers write stays untrained; the same words inside answers train.
    trained_text = "".join(_render(t, turns, template=template, enable_thinking=thinking)[1])
    assert "assistant user" in trained_text
    assert trained_text.count("assistant") == 1 and "system" not in trained_text
    eot = t.token_id("<|eot_id|>" if template == "llama3" else "<|im_end|>")
    assert sum(m for i, m in zip(ids, mask) if i == eot) == 2  # both answers' end-of-turn


def test_template_and_role_errors(tok, llama_tok):
    with pytest.raises(ValueError, match="unknown chat template 'qwen'"):
        render_chat([("user", "Hi"), ("assistant", "Yo")], tok, template="qwen")
    with pytest.raises(ValueError, match="unknown chat role"):
        render_chat([("tool", "Hi"), ("assistant", "Yo")], tok)
    with pytest.raises(ValueError, match=r"'llama3' needs special token\(s\) <\|begin_of_text"):
        check_template("llama3", tok)
    with pytest.raises(ValueError, match=r"'chatml' needs .*<\|im_start\|>, <\|im_end\|>.*llama3-"):
        render_chat([("user", "Hi"), ("assistant", "Yo")], llama_tok, template="chatml")
    check_template("qwen3", tok)
    check_template("llama3", llama_tok)


def test_auto_template_follows_the_tokenizer(tok, llama_tok):
    from titan_draft.data.chat.template import resolve_template

    assert resolve_template("auto", tok) == "qwen3"  # ChatML + think tokens
    assert resolve_template("auto", llama_tok) == "llama3"
    assert resolve_template("chatml", llama_tok) == "chatml"  # an explicit name is kept
    enc = tok.encoding
    qwen25 = Tokenizer("qwen2.5", tiktoken.Encoding(
        name="q25", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
        special_tokens={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}),
        pad_token="<|endoftext|>")
    assert resolve_template("auto", qwen25) == "chatml"
    bare = Tokenizer("bare", tiktoken.Encoding(
        name="bare", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
        special_tokens={"<|endoftext|>": 151643}), pad_token="<|endoftext|>")
    with pytest.raises(ValueError, match="'auto' found no known chat format"):
        resolve_template("auto", bare)


def test_mask_of_marks_the_tokens_starting_inside_a_span():
    """``_mask_of`` (a bisection per span) against its definition, token by token: repeated
    starts, empty spans, spans between tokens and past the last one."""
    import random

    from titan_draft.data.chat.template import _mask_of

    rng = random.Random(0)
    for _ in range(500):
        starts = sorted(rng.randint(0, 60) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(70), 2 * rng.randint(0, 4)))
        spans = [(cuts[i], cuts[i + 1], i // 2) for i in range(0, len(cuts), 2)]
        if cuts:
            spans.append((cuts[-1], cuts[-1], 9))  # an empty span marks nothing
        want = [any(b <= s < e for b, e, _ in spans) for s in starts]
        assert _mask_of(starts, spans) == want, (starts, spans)
