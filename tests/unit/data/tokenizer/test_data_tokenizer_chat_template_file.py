"""The target's own Jinja chat template is carried (read, exposed, written back), never rendered.

Where transformers looks is the reference: tokenizer_config.json's ``chat_template`` (a string,
or a list of named templates of which "default" is used), and a ``chat_template.jinja`` beside it,
which wins.
"""

import json
import os
import re

import pytest

from test_data_tokenizer_hf import tiny_json, write_json
from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
from titan_draft.data.tokenizer import build_tokenizer

# SmolLM2-135M-Instruct's template (it inserts a default system prompt).
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _folder(tmp_path, name, config=None, jinja=None):
    folder = tmp_path / name
    write_json(folder, tiny_json())
    if config is not None:
        write_json(folder, config, "tokenizer_config.json")
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return str(folder)


def test_read_from_config_and_jinja(tmp_path):
    assert build_tokenizer("qwen3").chat_template is None
    assert build_tokenizer(_folder(tmp_path, "none")).chat_template is None
    assert build_tokenizer(_folder(tmp_path, "no_key", {})).chat_template is None
    tok = build_tokenizer(_folder(tmp_path, "str", {"chat_template": SMOL_TEMPLATE}))
    assert tok.chat_template == SMOL_TEMPLATE
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert build_tokenizer(_folder(tmp_path, "list", {"chat_template": named})).chat_template == "D"
    no_default = {"chat_template": named[:1]}
    assert build_tokenizer(_folder(tmp_path, "nodefault", no_default)).chat_template is None
    # transformers >= 4.47 writes chat_template.jinja and prefers it to the config's.
    folder = _folder(tmp_path, "jinja", {"chat_template": "old"}, jinja=SMOL_TEMPLATE)
    assert build_tokenizer(folder).chat_template == SMOL_TEMPLATE
    assert build_tokenizer(_folder(tmp_path, "only_jinja", jinja="J")).chat_template == "J"
    # An edited template file is a new tokenizer (the encoding cache keys on it too).
    with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write("edited, and longer than before so the size differs")
    assert build_tokenizer(folder).chat_template.startswith("edited")


def test_bad_chat_template(tmp_path):
    folder = _folder(tmp_path, "bad", {"chat_template": {"default": "x"}})
    message = "tokenizer_config.json: chat_template is neither a string nor a list of"
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        build_tokenizer(folder)
    assert folder in str(info.value)
    folder = _folder(tmp_path, "bad_jinja", jinja="")
    with open(os.path.join(folder, "chat_template.jinja"), "wb") as f:
        f.write(b"\xff\xfe bad")
    with pytest.raises(ValueError, match=r"chat_template.jinja: not valid UTF-8"):
        build_tokenizer(folder)


def test_round_trip_through_save(tmp_path):
    tok = build_tokenizer(_folder(tmp_path, "src", {"chat_template": SMOL_TEMPLATE}))
    out = str(tmp_path / "out")
    save_hf_tokenizer(tok, out)  # the tokenizer's own template
    with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["chat_template"] == SMOL_TEMPLATE
    assert build_tokenizer(out).chat_template == SMOL_TEMPLATE
    save_hf_tokenizer(tok, out, chat_template="given")  # an explicit one wins
    assert build_tokenizer(out).chat_template == "given"
    save_hf_tokenizer(build_tokenizer(_folder(tmp_path, "plain")), str(tmp_path / "plain_out"))
    with open(tmp_path / "plain_out" / "tokenizer_config.json", encoding="utf-8") as f:
        assert "chat_template" not in json.load(f)
    transformers = pytest.importorskip("transformers")
    save_hf_tokenizer(tok, out)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == SMOL_TEMPLATE
