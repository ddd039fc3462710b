"""Where each block's anchor document lies in a packed row (``TargetFeatures.document_ids``).

A block anchored at ``a`` belongs to ``a``'s document ``[start, end)``: its context keys are
``start <= kv < a``, its RoPE positions ``(a - start) + k``, its labels and teacher positions
stop before ``end``. So a packed row of documents is, to a block-diffusion draft, several
sequences side by side, and every block computes what it computes with its document alone in a
row. Unpacked rows (``document_ids`` None) have no :class:`AnchorDocuments`: the code keeps its
one-document ops there (context from 0, labels up to ``valid_lengths``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_draft.protocols.features import TargetFeatures

__all__ = ["AnchorDocuments", "anchor_documents", "clamp_to_document", "row_spans"]


@dataclass
class AnchorDocuments:
    """``[B, N]`` int64 each, per anchor slot (an unused slot reads position 0's document)."""

    start: torch.Tensor
    """First position of the anchor's document."""
    end: torch.Tensor
    """One past the document's last real token."""

    def position(self, anchors: torch.Tensor) -> torch.Tensor:
        """The anchors' RoPE positions: their offsets inside their documents."""
        return anchors - self.start


def row_spans(features: TargetFeatures) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``features.document_spans()`` of packed rows, None for unpacked ones."""
    return None if features.document_ids is None else features.document_spans()


def anchor_documents(spans: tuple[torch.Tensor, torch.Tensor] | None, anchors: torch.Tensor) -> AnchorDocuments | None:
    """The anchors' documents from the row's ``(starts, ends)`` (None: unpacked rows)."""
    if spans is None:
        return None
    starts, ends = spans
    idx = anchors.to(torch.long)
    return AnchorDocuments(start=starts.gather(1, idx), end=ends.gather(1, idx))


def clamp_to_document(pos: torch.Tensor, docs: AnchorDocuments, seq: int) -> torch.Tensor:
    """``pos [B, N, b]`` (positions a block reads) moved inside its anchor's document: a slot
    past the document's end (weight 0) reads the document's last token, never the next
    document's, so nothing a block computes depends on another document."""
    first = docs.start[:, :, None]
    last = torch.maximum(docs.end - 1, docs.start)[:, :, None]
    return torch.minimum(pos, last).maximum(first).clamp(0, seq - 1)
