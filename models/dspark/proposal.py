"""DSpark at decode time: one block forward (the backbone's :class:`BlockDecoder`, the training
block over a cached context), then the Markov head left to right.

The block anchored at the newest committed token ``x_n`` (RoPE positions ``n .. n + b - 1``)
gives ``b`` final-norm rows; slot k's logits are ``lm_head(h_k) + W2 f_k`` with ``f_k`` from the
previous pick (the anchor for slot 0), so the chain is drafted greedily one slot after another,
exactly as training scores it with the data's tokens in place of the picks: SGLang's DSPARK
decode (``decode_as="sglang"``, the default, what a user serves). With
``confidence_threshold > 0`` the proposal stops before the first slot where the product of the
confidence head's ``c_0 .. c_k`` falls below it (DSpark's confidence-scheduled drafting: the
target is not asked to verify drafts it would likely reject).

The whole proposal (block forward, every slot's Markov step and pick, the running confidence
product) reads nothing on the host, so on a CUDA device it can replay as a CUDA graph like DFlash's
(``BlockDecoder``); the confidence cut-off is applied after the replay, from one host read of the
product. The tokens kept are exactly those of a walk that stops at the first slot below the
threshold: the chain runs left to right, so a slot's pick never depends on a later slot. At
T > 0 (``set_sampling``) each slot draws its token from softmax(z_k / T) with a uniform drawn on
the host before the proposal, and the NEXT slot's Markov input is the drawn token (DSpark's
definition); the proposal hands those distributions to the verify rule. On a CUDA device it
replays by default (``graphs=False`` drafts eagerly): on an H200 (SmolLM2 flavor, bf16, batch 1,
``scripts/bench_decode.py --proposals dspark``) 5.29 ms eagerly, 1.07 ms replayed;
``tests/gpu/test_proposals_gpu.py`` checks the replay against the eager proposal.

``decode_as="specforge_spec_generate"`` decodes as SpecForge's reference
``DSparkDraftModel.spec_generate`` (a6b6b023) does: ``b - 1`` drafts from slots ``1 .. b - 1``,
the Markov chain started from the anchor, slot 0 unused. That reads each slot one position
early for a draft trained as this one is (slot k's hidden state was taught ``x[a + k + 1]``
after ``x[a + k]``, it is asked for ``x[a + k]`` after ``x[a + k - 1]``), so it measures what
a user of that decoder sees, not what the draft can do.
"""

from __future__ import annotations

import torch

from models.block_diffusion.decoder import BlockDecoder
from models.dspark.model import DSparkDraft

DECODE_AS = {"sglang": 0, "specforge_spec_generate": 1}
"""Decode conventions -> the first block slot that drafts (module docstring)."""


class DSparkProposer(BlockDecoder):
    """:class:`~titan_draft.protocols.proposer.Proposer` of a plain (unsharded, eval-mode)
    :class:`DSparkDraft` with its frozen tables loaded.

    Args:
        draft: the draft.
        max_len: context positions to reserve up front.
        confidence_threshold: stop a proposal where the confidence product falls below this
            (0: never; needs the confidence head).
        decode_as: ``"sglang"`` (slots 0 .. b - 1 draft b tokens; SGLang's DSPARK, the convention
            the draft trains with) or ``"specforge_spec_generate"`` (slots 1 .. b - 1 draft
            b - 1 tokens; SpecForge's reference decoder). Module docstring.
        graphs: replay proposals as CUDA graphs (needs a CUDA device); None: on a CUDA device.
        graph_commit: commit a round's tokens with fixed shapes, a CUDA graph with ``graphs``
            (:class:`BlockDecoder`); None: where proposals replay.
    """

    def __init__(self, draft: DSparkDraft, max_len: int = 0, confidence_threshold: float = 0.0,
                 decode_as: str = "sglang", graphs: bool | None = None, graph_commit: bool | None = None):
        super().__init__(draft, graphs, graph_commit)
        a = draft.args
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        if confidence_threshold > 0 and draft.confidence_head is None:
            raise ValueError("confidence_threshold: this DSpark draft has no confidence head "
                             "(enable_confidence_head = false)")
        if decode_as not in DECODE_AS:
            raise ValueError(f"decode_as: {decode_as!r} is not one of {list(DECODE_AS)}")
        if decode_as != "sglang" and confidence_threshold > 0:
            raise ValueError(f"confidence_threshold: decode_as={decode_as!r} never reads the confidence head")
        self.confidence_threshold = float(confidence_threshold)
        self.decode_as = decode_as
        # the first slot that drafts
        self.first_slot = DECODE_AS[decode_as]
        self.num_draft_tokens = a.block_size - self.first_slot
        self.capture_layers = list(a.target_layer_ids)
        self.needs_last_hidden = False
        self.reset(max_len)

    def _chain(self, hidden: torch.Tensor, forced: torch.Tensor | None = None):
        """``(tokens [n], logits [n, V], confidence [n], survival [n])`` of every drafting slot of
        the block rows ``hidden [b, H]``, the chain started from the anchor: each slot's pick (or
        ``forced[j]``) is the next slot's previous token; ``survival`` is the running product
        ``c_0 * .. * c_k`` in float64 (the multiplication order of a walk that stops on it).
        Device tensors only: it may be a graph."""
        d = self.draft
        head, w = d.markov_head, d.target_lm_head
        prev, state, survival = self._anchor, None, None
        tokens, logits, conf, surv = [], [], [], []
        for j, k in enumerate(range(self.first_slot, hidden.shape[0])):
            h = hidden[k : k + 1]
            f, e, state = head.step(h, prev, state)
            if d.confidence_head is not None:
                c = torch.sigmoid(d.confidence_head(h, e).to(self.acc_dtype))
                survival = c.double() if survival is None else survival * c.double()
                conf.append(c)
                surv.append(survival)
            z = (h.to(w.dtype) @ w.t()).to(self.acc_dtype) + head.markov_w2(f).to(self.acc_dtype)
            pick = self.sampler.pick(z, j)  # argmax at T = 0, else a draw from softmax(z / T)
            tokens.append(pick)
            logits.append(z)
            prev = pick if forced is None else forced[j : j + 1]
        tokens, logits = torch.cat(tokens), torch.cat(logits)
        if not conf:
            ones = torch.ones(tokens.shape[0], dtype=torch.float64, device=self.device)
            return tokens, logits, ones.to(self.acc_dtype), ones
        return tokens, logits, torch.cat(conf), torch.cat(surv)

    @staticmethod
    def _kept(survival: torch.Tensor, stop_below: float) -> int:
        """Slots before the first whose confidence product is below ``stop_below`` (one host read)."""
        if stop_below <= 0:
            return survival.shape[0]
        return int((survival >= stop_below).to(torch.long).cumprod(0).sum())

    @torch.no_grad()
    def walk(self, last_token: int, forced: list[int] | None = None, stop_below: float = 0.0):
        """``(tokens [<= n], logits [<= n, V], confidence [<= n])`` of the block after
        ``last_token`` (``n = num_draft_tokens``, from slot ``first_slot`` on), eagerly: each
        slot's pick is the next slot's previous token (``forced`` gives them instead). With
        ``stop_below > 0`` only the slots before the first whose confidence product
        ``c_0 * .. * c_k`` is below it are returned."""
        hidden = self.block_hidden(last_token)  # [b, H]
        forced_t = None if forced is None else torch.tensor(forced, dtype=torch.long, device=self.device)
        tokens, logits, conf, survival = self._chain(hidden, forced_t)
        keep = self._kept(survival, stop_below)
        return tokens[:keep], logits[:keep], conf[:keep]

    def _propose(self):
        """The whole proposal from the anchor, the length and the buffers (graph-safe)."""
        return self._chain(self.block_hidden())

    @property
    def settings(self) -> dict:
        return {"decode_as": self.decode_as, "confidence_threshold": self.confidence_threshold,
                "num_draft_tokens": self.num_draft_tokens}

    @torch.no_grad()
    def propose(self, last_token: int) -> torch.Tensor:
        tokens, logits, _, survival = self.run_proposal(last_token, self._propose)
        keep = self._kept(survival, self.confidence_threshold)
        # sampling: each slot's q is softmax(z_k / T) with z_k read after the SAMPLED previous token
        self.draft_probs = self.sampler.probs(logits[:keep]) if self.sampler.sampling else None
        return tokens[:keep]
