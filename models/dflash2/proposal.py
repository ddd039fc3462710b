"""DFlash / DFlash2 at decode time: one block forward (the backbone's :class:`BlockDecoder`, the
training block over a cached context) drafts ``block_size - 1`` tokens.

Slot ``k >= 1`` predicts the token ``k`` places after the anchor (slot 0 is not a prediction, as
in training). DFlash takes each slot's argmax; DFlash2's candidate selector walks the unary
top-K left to right from the anchor, each pick becoming the next slot's predecessor.
"""

from __future__ import annotations

import torch

from models.common import transform_logits
from models.common.sampling import inverse_cdf_pick
from models.block_diffusion.decoder import BlockDecoder
from models.dflash2.model import DFlash2Draft


class DFlashProposer(BlockDecoder):
    """:class:`~titan_draft.protocols.proposer.Proposer` of a plain (unsharded, eval-mode)
    :class:`DFlash2Draft` with its frozen tables loaded (``graphs``, ``graph_commit``: as
    :class:`BlockDecoder`'s).

    Args:
        outside_candidates: at T > 0, a DFlash2 slot's q keeps the unary's probability outside the
            selector's top-K candidates, and the candidates share the unary's top-K mass as the
            selector distributes it; False: q is the selector's distribution, zero outside the
            candidates. None (the default): on wherever the draft has a selector. T = 0 walks
            the candidates either way. On the 11-minute SmolLM2 recipe it lifts tau at T = 1 from
            1.595 to 1.680 (docs/benchmarks/2026-12-06-dflash2-11min.md): with the target's
            sampled token outside a slot's 16 candidates, q = 0 there can never draft it.
    """

    def __init__(self, draft: DFlash2Draft, max_len: int = 0, graphs: bool | None = None,
                 graph_commit: bool | None = None, outside_candidates: bool | None = None):
        if outside_candidates and not draft.args.selector_enabled:
            raise ValueError("outside_candidates: this draft has no candidate selector (plain DFlash samples "
                             "the whole vocabulary already)")
        super().__init__(draft, graphs, graph_commit)
        self.outside_candidates = draft.args.selector_enabled if outside_candidates is None else outside_candidates
        a = draft.args
        self.num_draft_tokens = a.block_size - 1
        self.capture_layers = list(a.target_layer_ids)
        self.needs_last_hidden = False
        self.reset(max_len)

    @property
    def settings(self) -> dict:
        return {"outside_candidates": self.outside_candidates}

    def propose(self, last_token: int) -> torch.Tensor:
        tokens, probs = self.run_proposal(last_token, self._propose)
        self.draft_probs = probs if self.sampler.sampling else None
        return tokens

    def _propose(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [b - 1], their draft distributions [b - 1, V])`` after the anchor token
        (device state only: it may be a graph); the distributions are only meaningful when
        sampling (at T = 0 the logits stand in, unused)."""
        d, a = self.draft, self.draft.args
        hidden = self.block_hidden()[1:]  # slots 1 .. b - 1
        w = d.target_lm_head
        logits = transform_logits((hidden.to(w.dtype) @ w.t()).to(self.acc_dtype),
                                  a.output_multiplier, a.final_logit_softcapping)
        if not a.selector_enabled:
            if not self.sampler.sampling:
                return logits.argmax(dim=-1), logits
            # the slots are drafted in parallel: each is drawn from its own q, independently
            probs = self.sampler.probs(logits)
            return inverse_cdf_pick(probs, self.sampler.u[: probs.shape[0]]), probs
        return self._selector_walk(hidden, logits)

    def _selector_walk(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Walk over each slot's unary top-K: the pick of slot k is slot k + 1's predecessor (the
        anchor is slot 1's), as in training's teacher-forced scores. Greedy at T = 0; sampling,
        each pick is drawn from the selector's tempered distribution over the candidates, which
        is that slot's q (zero outside its candidates, or the unary's there with
        ``outside_candidates``)."""
        a = self.draft.args
        values, cands = logits.topk(a.selector_top_k, dim=-1)  # [b - 1, K]
        picks, probs = [], []
        prev = self._anchor
        unary = self.sampler.probs(logits) if self.sampler.sampling and self.outside_candidates else None
        for k in range(hidden.shape[0]):
            scores = self.draft.candidate_selector(hidden[k : k + 1], prev, cands[k : k + 1], values[k : k + 1])
            if unary is not None:
                # the selector reorders the unary's top-K mass; the rest of the vocabulary keeps
                # the unary's own, so a target token outside the candidates can still be drafted
                inside = unary[k].gather(0, cands[k]).sum()
                q = unary[k].scatter(0, cands[k], self.sampler.probs(scores)[0] * inside)
                prev = inverse_cdf_pick(q.unsqueeze(0), self.sampler.u[k : k + 1])
                probs.append(q.to(logits.dtype))
            elif self.sampler.sampling:
                q = self.sampler.probs(scores)  # [1, K]
                prev = cands[k].gather(0, inverse_cdf_pick(q, self.sampler.u[k : k + 1]))
                probs.append(torch.zeros_like(logits[k]).scatter(0, cands[k], q[0].to(logits.dtype)))
            else:
                prev = cands[k].gather(0, scores[0].argmax().view(1))  # no host sync: graph-safe
            picks.append(prev)
        return torch.cat(picks), (torch.stack(probs) if probs else logits)
