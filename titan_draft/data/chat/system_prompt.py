"""``data.system_prompt = "auto"``: the system turn the target's own chat template adds to a
conversation that has none.

Formats are rendered in code (chat_template.py), but some targets' Jinja templates insert a
default system prompt (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging
Face"; Qwen2.5: "You are Qwen, created by Alibaba Cloud. ..."), and a served conversation starts
with it. So the template shipped in tokenizer_config.json is rendered once, in a sandbox, for a
single user turn, and the system turn it writes before that turn is taken as the default.
Llama-3.1+ templates also write a system turn, "Cutting Knowledge Date: ... Today Date: <day>";
chat_template.py explains why it is not rendered, so 'auto' gives none for the llama3 format.
"""

from __future__ import annotations

from titan_draft.data.tokenizer import Tokenizer

__all__ = ["AUTO", "default_system_prompt", "resolve_system_prompt"]

AUTO = "auto"
_PROBE = "\x00probe question\x00"


def _render_jinja(source: str, tokenizer: Tokenizer) -> str:
    # the environment of the 'jinja' format, which also knows {% generation %} markers
    from titan_draft.data.chat.jinja_template import render_text

    return render_text(source, [{"role": "user", "content": _PROBE}], generation_prompt=True,
                       bos=tokenizer.bos_token or "", eos=tokenizer.eos_token or "")


def default_system_prompt(tokenizer: Tokenizer, template: str) -> str:
    """The system prompt the target's Jinja template adds when a ChatML conversation has none
    ('' when it adds none, when the tokenizer ships no template, or for other formats)."""
    if template not in ("chatml", "qwen3") or not tokenizer.chat_template:
        return ""
    try:
        text = _render_jinja(tokenizer.chat_template, tokenizer)
    except Exception as e:  # a template we cannot run: say so, and render no system turn
        raise ValueError(f"data.system_prompt 'auto': the target's chat template does not render "
                         f"({type(e).__name__}: {e}); set data.system_prompt explicitly") from None
    head = text[: text.find(_PROBE)] if _PROBE in text else ""
    start, end = "<|im_start|>system\n", "<|im_end|>"
    if head.startswith(start) and end in head:
        return head[len(start) : head.index(end)]
    return ""


def resolve_system_prompt(value: str, tokenizer: Tokenizer, template: str) -> str:
    """``data.system_prompt`` as rendered: 'auto' -> :func:`default_system_prompt`."""
    return default_system_prompt(tokenizer, template) if value == AUTO else value
