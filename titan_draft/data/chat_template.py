"""Chat templates rendered in code, and the assistant loss mask.

Why in code and not via a Jinja template: the draft is trained to predict what the target says
as the assistant, so the mask must cover exactly the assistant's tokens. We render the whole
conversation as one string and tokenize it in one call (so BPE merges are the ones an HF
tokenizer gives for that string, which is what the server will see), and then map every token
back to the byte span it came from. A token is trained on iff its first byte lies inside an
assistant span; no prefix re-encoding tricks, no regex over decoded text.
"""

from __future__ import annotations

import itertools
import unicodedata
from typing import Sequence

from titan_draft.data.tokenizer import Tokenizer

__all__ = ["ROLES", "SUPPORTED_TEMPLATES", "check_template", "render_chat"]

ROLES = ("system", "user", "assistant")
SUPPORTED_TEMPLATES = ("qwen",)

Turn = tuple[str, str]


def check_template(template: str) -> None:
    """Raise ValueError for a template name ``render_chat`` does not know."""
    if template not in SUPPORTED_TEMPLATES:
        raise ValueError(
            f"unknown chat template {template!r}; supported: {', '.join(SUPPORTED_TEMPLATES)}"
        )


def _render_qwen(turns: Sequence[Turn], system_prompt: str) -> tuple[str, list[tuple[int, int]]]:
    """ChatML text of ``turns`` and the byte spans ``[start, end)`` of what the assistant says.

    The span is the assistant text plus its ``<|im_end|>``: the end-of-turn token is what tells
    the server to stop, so the draft must learn to predict it. The ``<|im_start|>assistant\\n``
    header is given by the server, never generated, and the trailing newline comes after the stop.
    """
    if system_prompt and not any(role == "system" for role, _ in turns):
        turns = [("system", system_prompt), *turns]
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    offset = 0  # bytes, because token offsets come from token bytes

    def add(piece: str) -> int:
        nonlocal offset
        pieces.append(piece)
        offset += len(piece.encode("utf-8"))
        return offset

    for role, text in turns:
        if role not in ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {ROLES}")
        # The tokenizer NFC-normalizes; spans must be measured on the text it actually encodes.
        # Per turn equals the whole string: nothing composes with the "\n" before a text or the
        # "<" after it.
        text = unicodedata.normalize("NFC", text)
        start = add(f"<|im_start|>{role}\n")
        end = add(f"{text}<|im_end|>")
        add("\n")
        if role == "assistant":
            spans.append((start, end))
    return "".join(pieces), spans


def render_chat(
    turns: Sequence[Turn],
    tokenizer: Tokenizer,
    template: str = "qwen",
    system_prompt: str = "",
) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of a conversation.

    Args:
        turns: normalized ``(role, text)`` pairs, role in ``ROLES``.
        tokenizer: the target's tokenizer.
        template: chat format name (``SUPPORTED_TEMPLATES``).
        system_prompt: system turn prepended when the conversation has none (empty: none).

    Returns:
        ``(input_ids, loss_mask)`` of equal length; ``loss_mask[i]`` is True for tokens the draft
        is trained to predict (assistant text and its ``<|im_end|>``).
    """
    check_template(template)
    text, spans = _render_qwen(turns, system_prompt)
    ids = tokenizer.encode(text, allow_special=True)
    # Start byte of each token: the token bytes tile the UTF-8 text, so a running sum of their
    # lengths is each token's offset.
    starts = list(itertools.accumulate((len(b) for b in tokenizer.token_bytes(ids)), initial=0))
    if starts[-1] != len(text.encode("utf-8")):
        # Only possible if encode() changed the text (normalization); the mask would be shifted.
        raise RuntimeError("chat template: token bytes do not cover the rendered text")
    mask = [False] * len(ids)
    span_iter = iter(spans)
    span = next(span_iter, None)
    for i, start in zip(range(len(ids)), starts):
        # Spans and token starts are both increasing, so one forward walk suffices.
        while span is not None and start >= span[1]:
            span = next(span_iter, None)
        if span is None:
            break
        mask[i] = start >= span[0]
    return ids, mask
