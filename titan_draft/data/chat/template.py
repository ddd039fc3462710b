"""Chat templates rendered in code, and the assistant loss mask.

Why in code and not via a Jinja template: the draft is trained to predict what the target says
as the assistant, so the mask must cover exactly the assistant's tokens. We render the whole
conversation as one string and tokenize it in one call (so BPE merges are the ones an HF
tokenizer gives for that string, which is what the server will see), and then map every token
back to the byte span it came from. A token is trained on iff its first byte lies inside an
assistant span; no prefix re-encoding tricks, no regex over decoded text. Token starts come from
the tokenizer (``encode_with_offsets``), not from adding up token lengths, which would shift the
mask after a byte the BPE drops.

Formats (each renders what the model's official Jinja chat template renders for the same
messages, without tools):

- ``chatml``: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn (Qwen2/Qwen2.5 style;
  Qwen2.5's template adds a default system prompt when there is none, we only add
  ``data.system_prompt``).
- ``qwen3``: ChatML with Qwen3's thinking rules (see ``_render_qwen3``).
- ``llama3``: ``<|begin_of_text|>`` then ``<|start_header_id|>{role}<|end_header_id|>\\n\\n
  {content.strip()}<|eot_id|>`` per turn. Llama-3.1/3.2/3.3 templates also open every
  conversation with a system turn that starts "Cutting Knowledge Date: December 2023\\nToday
  Date: <day>". We do not render it: it is prompt (never trained on), its date changes per
  request, and a user who wants it can put it in ``data.system_prompt``.

What is trained on (the mask): an assistant turn's content and its end-of-turn token
(``<|im_end|>`` / ``<|eot_id|>``: it tells the server to stop, so the draft must predict it).
Never a role header (the server writes it), never the newline after ``<|im_end|>`` (it comes
after the stop). Qwen3's think block is trained on in thinking mode (the model writes it) and
not in non-thinking mode (the server writes the empty block into the prompt).

A separate reasoning field (``Turn.reasoning``) is rendered where the format has a place for it:
Qwen3 puts it in its think block; ``chatml`` and ``llama3`` have no reasoning channel, so it is
written inline before the content as ``<think>\\n{reasoning}\\n</think>\\n\\n`` (what a reasoning
model emits in these formats) and trained on like the rest of the answer.
"""

from __future__ import annotations

import bisect
import itertools

from typing import Callable, NamedTuple, Optional, Sequence

from titan_draft.data.tokenizer import Tokenizer

__all__ = [
    "ROLES", "SUPPORTED_TEMPLATES", "Turn", "check_template", "render_chat", "resolve_template",
    "template_special_tokens"]

ROLES = ("system", "user", "assistant")
SUPPORTED_TEMPLATES = ("chatml", "qwen3", "llama3", "jinja")

# Special tokens each format writes; a tokenizer without them would encode them as plain text
# and silently train on a format the target has never seen.
_SPECIAL_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen3": ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "jinja": (),  # the folder's template writes whatever its family uses (jinja_template.py)
}


class Turn(NamedTuple):
    """One message of a conversation."""

    role: str
    """One of ``ROLES``."""
    content: str
    """The message text (for an assistant, its answer; it may hold an inline think block)."""
    reasoning: Optional[str] = None
    """An assistant's separate reasoning (OpenAI-style ``reasoning_content``). None: not given,
    so Qwen3 looks for ``</think>`` in the content, as its template does."""


def template_special_tokens(template: str) -> tuple[str, ...]:
    """The special tokens format ``template`` writes (none of them can be a draft's mask token)."""
    check_template(template)
    return _SPECIAL_TOKENS[template]


def check_template(template: str, tokenizer: Optional[Tokenizer] = None) -> None:
    """Raise ValueError for a template name ``render_chat`` does not know, or (given a
    tokenizer) one whose special tokens the tokenizer lacks."""
    if template not in SUPPORTED_TEMPLATES:
        raise ValueError(
            f"unknown chat template {template!r}; supported: {', '.join(SUPPORTED_TEMPLATES)}"
        )
    if tokenizer is None:
        return
    if template == "jinja" and not tokenizer.chat_template:
        raise ValueError(f"chat template 'jinja': tokenizer {tokenizer.name!r} ships no chat_template")
    specials = tokenizer.encoding.special_tokens_set
    missing = [tok for tok in _SPECIAL_TOKENS[template] if tok not in specials]
    if missing:
        raise ValueError(
            f"chat template {template!r} needs special token(s) {', '.join(missing)}, which "
            f"tokenizer {tokenizer.name!r} does not have (wrong template for this target?)"
        )


def resolve_template(template: str, tokenizer: Tokenizer) -> str:
    """``template``, or for ``"auto"`` the target family's format, read off its tokenizer:
    Llama-3 header tokens -> 'llama3'; ChatML with think tokens (Qwen3) -> 'qwen3'; ChatML
    without them (Qwen2/2.5) -> 'chatml'; none of them but a Jinja template shipped with the
    tokenizer -> 'jinja' (the folder's own template)."""
    if template != "auto":
        return template
    for name in ("llama3", "qwen3", "chatml"):  # most specific first: qwen3 extends chatml
        if all(tok in tokenizer.encoding.special_tokens_set for tok in _SPECIAL_TOKENS[name]):
            return name
    if tokenizer.chat_template:
        return "jinja"
    raise ValueError(
        f"'auto' found no known chat format in tokenizer {tokenizer.name!r} (no ChatML or "
        f"Llama-3 header tokens); set data.chat_template to one of {', '.join(SUPPORTED_TEMPLATES)}"
    )


class _Rendered:
    """The rendered text, built piece by piece, and the byte spans of trained pieces."""

    def __init__(self, normalize: Callable[[str], str]) -> None:
        self.normalize = normalize
        self.pieces: list[str] = []
        self.spans: list[tuple[int, int, int]] = []  # (start, end, turn index), in bytes
        self.offset = 0  # bytes, because token offsets come from token bytes

    def prompt(self, piece: str) -> None:
        # Spans must be measured on the text the tokenizer actually encodes (Qwen's NFC-normalizes
        # it). Per piece equals the whole string: pieces start after "\n" or a special token and
        # end before "<", and nothing composes across those.
        piece = self.normalize(piece)
        self.pieces.append(piece)
        self.offset += len(piece.encode("utf-8"))

    def trained(self, piece: str, turn: int) -> None:
        start = self.offset
        self.prompt(piece)
        self.spans.append((start, self.offset, turn))

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _inline_reasoning(turn: Turn) -> str:
    """Answer text for formats without a reasoning channel: reasoning first, as emitted."""
    if not turn.reasoning:
        return turn.content
    return f"<think>\n{turn.reasoning.strip(chr(10))}\n</think>\n\n{turn.content.lstrip(chr(10))}"


def _render_chatml(turns: Sequence[Turn], out: _Rendered) -> None:
    for i, turn in enumerate(turns):
        out.prompt(f"<|im_start|>{turn.role}\n")
        if turn.role == "assistant":
            out.trained(_inline_reasoning(turn) + "<|im_end|>", i)
        else:
            out.prompt(turn.content + "<|im_end|>")
        out.prompt("\n")


def _render_llama3(turns: Sequence[Turn], out: _Rendered) -> None:
    out.prompt("<|begin_of_text|>")
    for i, turn in enumerate(turns):
        out.prompt(f"<|start_header_id|>{turn.role}<|end_header_id|>\n\n")
        if turn.role == "assistant":
            out.trained(_inline_reasoning(turn).strip() + "<|eot_id|>", i)
        else:
            out.prompt(turn.content.strip() + "<|eot_id|>")


def _split_reasoning(turn: Turn) -> tuple[str, str]:
    """``(reasoning, content)`` of an assistant turn, split the way Qwen3's template splits it:
    a separate reasoning field wins; otherwise the text before the first ``</think>`` (after
    its last ``<think>``) is reasoning and the text after the last ``</think>`` is content."""
    if turn.reasoning is not None:
        return turn.reasoning, turn.content
    content = turn.content
    if "</think>" not in content:
        return "", content
    head, tail = content.partition("</think>")[0], content.rpartition("</think>")[2]
    return head.rstrip("\n").split("<think>")[-1].lstrip("\n"), tail.lstrip("\n")


def _last_query_index(turns: Sequence[Turn]) -> int:
    """Index of the last user turn that is a query (not a tool response), as Qwen3 defines it;
    the last index when there is none."""
    for i in range(len(turns) - 1, -1, -1):
        text = turns[i].content
        tool_response = text.startswith("<tool_response>") and text.endswith("</tool_response>")
        if turns[i].role == "user" and not tool_response:
            return i
    return len(turns) - 1


def _render_qwen3(turns: Sequence[Turn], out: _Rendered, *, enable_thinking: bool) -> None:
    """Qwen3's rules: an assistant turn after the last user query gets a think block
    ``<think>\\n{reasoning}\\n</think>\\n\\n`` when it is the last turn or has reasoning; every
    other assistant turn is plain content (history reasoning is dropped, as the template does).

    ``enable_thinking=False`` renders what a server running without thinking sees: reasoning is
    dropped, so the last turn gets the empty block ``<think>\\n\\n</think>\\n\\n``, which is the
    end of the server's generation prompt and therefore not trained on. With thinking on the
    model writes the block itself (``<|im_start|>assistant\\n`` is the whole generation prompt),
    so it is trained on.
    """
    last_query = _last_query_index(turns)
    for i, turn in enumerate(turns):
        if turn.role != "assistant":
            out.prompt(f"<|im_start|>{turn.role}\n{turn.content}<|im_end|>\n")
            continue
        reasoning, content = _split_reasoning(turn)
        if not enable_thinking:
            reasoning = ""
        out.prompt("<|im_start|>assistant\n")
        if i > last_query and (i == len(turns) - 1 or reasoning):
            think = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
            answer = content.lstrip("\n") + "<|im_end|>"
            if enable_thinking:
                out.trained(think + answer, i)
            else:
                out.prompt(think)
                out.trained(answer, i)
        else:
            out.trained(content + "<|im_end|>", i)
        out.prompt("\n")


def _render(
    turns: Sequence[Turn],
    template: str,
    system_prompt: str,
    enable_thinking: bool,
    normalize: Callable[[str], str],
    tokenizer: Optional[Tokenizer] = None,
) -> _Rendered:
    turns = [Turn(*t) for t in turns]
    for turn in turns:
        if turn.role not in ROLES:
            raise ValueError(f"unknown chat role {turn.role!r}; expected one of {ROLES}")
    if system_prompt and not any(turn.role == "system" for turn in turns):
        turns = [Turn("system", system_prompt), *turns]
    out = _Rendered(normalize)
    if template == "jinja":
        from titan_draft.data.chat.jinja_template import render_jinja

        render_jinja(turns, tokenizer.chat_template if tokenizer else None, out, normalize=normalize,
                     bos=(tokenizer.bos_token or "") if tokenizer else "", eos=(tokenizer.eos_token or "") if tokenizer else "")
    elif template == "chatml":
        _render_chatml(turns, out)
    elif template == "qwen3":
        _render_qwen3(turns, out, enable_thinking=enable_thinking)
    else:
        _render_llama3(turns, out)
    return out


def _mask_of(starts: Sequence[int], spans: Sequence[tuple[int, int, int]]) -> list[bool]:
    """True for each token whose start byte lies in a span (both sorted). A bisection per span,
    not a walk per token: the training loader and EAGLE-3's vocabulary count render every row."""
    mask = [False] * len(starts)
    for begin, end, _ in spans:
        lo, hi = bisect.bisect_left(starts, begin), bisect.bisect_left(starts, end)
        mask[lo:hi] = [True] * (hi - lo)
    return mask


def render_chat(
    turns: Sequence[Turn | tuple[str, str] | tuple[str, str, Optional[str]]],
    tokenizer: Tokenizer,
    template: str = "chatml",
    system_prompt: str = "",
    *,
    enable_thinking: bool = True,
    last_turn_only: bool = False,
) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of a conversation.

    Args:
        turns: ``Turn``s (or plain ``(role, content[, reasoning])`` tuples), role in ``ROLES``.
        tokenizer: the target's tokenizer.
        template: chat format name (``SUPPORTED_TEMPLATES``).
        system_prompt: system turn prepended when the conversation has none (empty: none).
        enable_thinking: ``qwen3`` only: render for a server with thinking on (see
            ``_render_qwen3``); ignored by the other formats.
        last_turn_only: train on the last assistant turn only; earlier ones are context.

    Returns:
        ``(input_ids, loss_mask)`` of equal length; ``loss_mask[i]`` is True for tokens the draft
        is trained to predict (assistant text and its end-of-turn token).
    """
    check_template(template, tokenizer)
    rendered = _render(turns, template, system_prompt, enable_thinking, tokenizer.normalize, tokenizer)
    spans = rendered.spans
    if last_turn_only and spans:
        spans = [span for span in spans if span[2] == spans[-1][2]]
    text = rendered.text
    # The tokenizer says where each token starts: a running sum of token lengths would drift
    # after a byte the BPE drops (SmolLM2 has no token for some control bytes).
    ids, starts = tokenizer.encode_with_offsets(text, allow_special=True)
    if starts[-1] != len(text.encode("utf-8")):
        # Only possible if encode() changed the text (normalization); the mask would be shifted.
        raise RuntimeError("chat template: the tokenizer encoded a different text than rendered")
    if template == "jinja":  # transformers' rule for a folder's template: a token touching an answer
        return ids, _overlap_mask(starts, spans)
    return ids, _mask_of(starts[:-1], spans)


def user_turn_prefix(tokenizer: Tokenizer, template: str, system_prompt: str = "") -> list[int]:
    """Token ids of a conversation up to where its first user message starts (the system turn and
    the user turn's header), cut from ``render_chat``'s own rendering so both agree. Sampling
    questions from the target starts here."""
    check_template(template, tokenizer)
    mark = "@@question@@"
    text = _render([Turn("user", mark), Turn("assistant", "x")], template, system_prompt, False,
                   tokenizer.normalize, tokenizer).text
    if text.count(mark) != 1:
        raise ValueError(f"chat template {template!r}: no single place for a question in its rendering")
    return tokenizer.encode(text[: text.index(mark)])


def _overlap_mask(bounds: Sequence[int], spans: Sequence[tuple[int, int, int]]) -> list[bool]:
    """True for each token ``[bounds[i], bounds[i + 1])`` that shares a byte with a span (what
    ``return_assistant_tokens_mask`` marks: a BPE token that merges the prompt's last space
    with the answer's first word is the answer's)."""
    return [any(a < end and b > start for start, end, _ in spans) for a, b in itertools.pairwise(bounds)]
