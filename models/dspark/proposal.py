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
    """

    def __init__(self, draft: DSparkDraft, max_len: int = 0, confidence_threshold: float = 0.0,
                 decode_as: str = "sglang"):
        # eager: the confidence product is read on the host slot by slot, which a graph cannot do
        super().__init__(draft, graphs=False)
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

    @torch.no_grad()
    def walk(self, last_token: int, forced: list[int] | None = None, stop_below: float = 0.0):
        """``(tokens [<= n], logits [<= n, V], confidence [<= n])`` of the block after
        ``last_token`` (``n = num_draft_tokens``, from slot ``first_slot`` on): each slot's pick is
        the next slot's previous token (``forced`` gives them instead). With ``stop_below > 0``
        the walk ends before the first slot whose confidence product ``c_0 * .. * c_k`` is below
        it (its Markov step is not computed)."""
        d = self.draft
        hidden = self.block_hidden(last_token)  # [b, H]
        head, w = d.markov_head, d.target_lm_head
        prev = torch.tensor([last_token], device=self.device)
        state, survival = None, 1.0
        tokens, logits, conf = [], [], []
        for j, k in enumerate(range(self.first_slot, hidden.shape[0])):
            h = hidden[k : k + 1]
            f, e, state = head.step(h, prev, state)
            if d.confidence_head is not None:
                c = torch.sigmoid(d.confidence_head(h, e).to(self.acc_dtype))
                survival *= float(c)
                if survival < stop_below:
                    break
                conf.append(c)
            z = (h.to(w.dtype) @ w.t()).to(self.acc_dtype) + head.markov_w2(f).to(self.acc_dtype)
            pick = z.argmax(dim=-1)
            tokens.append(pick)
            logits.append(z)
            prev = pick if forced is None else torch.tensor([forced[j]], device=self.device)
        if not tokens:
            empty = torch.empty(0, dtype=torch.long, device=self.device)
            return empty, torch.empty(0, w.shape[0], dtype=self.acc_dtype, device=self.device), \
                torch.empty(0, dtype=self.acc_dtype, device=self.device)
        confidence = torch.cat(conf) if conf else torch.ones(len(tokens), dtype=self.acc_dtype, device=self.device)
        return torch.cat(tokens), torch.cat(logits), confidence

    @torch.no_grad()
    def propose(self, last_token: int) -> torch.Tensor:
        return self.walk(last_token, stop_below=self.confidence_threshold)[0]
