"""``data.chat_template = "jinja"``: the target folder's own Jinja chat template, for families
whose format is not rendered in code (template.py).

The template is run in jinja2's sandbox with the settings and helpers transformers gives it
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, ``bos_token``,
``eos_token``). The loss covers exactly the assistant's tokens, found one of two ways:

- the template marks them with ``{% generation %} ... {% endgeneration %}`` (transformers'
  ``return_assistant_tokens_mask`` reads the same markers): the text inside the markers;
- otherwise by rendering twice per assistant message ``k``: messages ``0..k-1`` with the
  generation prompt, then messages ``0..k``; what the second adds after the first is the
  answer (trailing whitespace after the end-of-turn token excluded: it follows the stop). Each
  render must be a prefix of the next and of the whole conversation's render, or the template
  cannot mark assistant spans and the run is refused with one line.

A system turn: ``data.system_prompt`` text is prepended as a system message when a conversation
has none; 'auto' leaves it to the template, which writes its own default (if any) itself.
"""

from __future__ import annotations

import datetime
import functools
import re
from collections.abc import Callable, Sequence

__all__ = ["JINJA", "has_generation_markers", "render_jinja", "render_text"]

JINJA = "jinja"
# private-use characters: never in chat data (checked) and never merged by a BPE
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_markers(source: str) -> bool:
    return bool(_MARKER.search(source))


@functools.lru_cache(maxsize=4)
def _compile(source: str):
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}``: wraps what its body renders in the two marker characters."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _messages(turns) -> list[dict]:
    out = []
    for t in turns:
        if _OPEN in t.content or _CLOSE in t.content:
            raise ValueError("chat template 'jinja': a message holds a private-use marker character (U+E000/E001)")
        message = {"role": t.role, "content": t.content}
        if t.reasoning is not None:
            message["reasoning_content"] = t.reasoning
        out.append(message)
    return out


def _run(source: str, messages: list[dict], generation_prompt: bool, bos: str, eos: str) -> str:
    try:
        return _compile(source).render(messages=messages, add_generation_prompt=generation_prompt,
                                       bos_token=bos, eos_token=eos)
    except Exception as e:  # noqa: BLE001 - the template's raise_exception or any jinja2 error: one line
        raise ValueError(f"chat template 'jinja': the target's template does not render ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def render_text(source: str, messages: list[dict], *, generation_prompt: bool, bos: str, eos: str) -> str:
    """What template ``source`` renders for ``messages``, generation markers removed (jinja2's
    own errors propagate: the caller names the setting)."""
    text = _compile(source).render(messages=messages, add_generation_prompt=generation_prompt,
                                   bos_token=bos, eos_token=eos)
    return text.replace(_OPEN, "").replace(_CLOSE, "")


def _answer_spans(source: str, messages: list[dict], full: str, bos: str, eos: str) -> list[tuple[int, int]]:
    """Character spans of each assistant message in ``full``, by the render-twice rule."""
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _run(source, messages[:k], True, bos, eos)
        upto = _run(source, messages[: k + 1], False, bos, eos)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError("chat template 'jinja': the target's template cannot mark assistant spans (rendering "
                             "fewer messages does not give a prefix of the conversation); add {% generation %} "
                             "markers to it or set data.chat_template to a built-in format")
        end = len(upto.rstrip())
        if end <= len(before):
            raise ValueError(f"chat template 'jinja': the target's template renders nothing for assistant message {k}")
        spans.append((len(before), end))
    return spans


def render_jinja(turns: Sequence, source: str | None, out, *, bos: str, eos: str,
                 normalize: Callable[[str], str]) -> None:
    """Render ``turns`` with template ``source`` into ``out`` (template.py's ``_Rendered``):
    assistant text as trained pieces, everything else as prompt."""
    if not source:
        raise ValueError("chat template 'jinja': the target's tokenizer ships no chat_template "
                         "(tokenizer_config.json or chat_template.jinja)")
    messages = _messages(turns)
    full = _run(source, messages, False, bos, eos)
    if has_generation_markers(source):
        pieces = re.split(f"([{_OPEN}{_CLOSE}])", full)
        inside, turn = False, -1
        for piece in pieces:
            if piece in (_OPEN, _CLOSE):
                inside = piece == _OPEN
                turn += inside
            elif inside:
                out.trained(piece, turn)
            elif piece:
                out.prompt(piece)
        if turn < 0 and any(m["role"] == "assistant" for m in messages):
            raise ValueError("chat template 'jinja': the template's {% generation %} markers enclose no assistant text")
        return
    at = 0
    for turn, (start, end) in enumerate(_answer_spans(source, messages, full, bos, eos)):
        out.prompt(full[at:start])
        out.trained(full[start:end], turn)
        at = end
    out.prompt(full[at:])
    del normalize  # out.prompt/trained normalize each piece
