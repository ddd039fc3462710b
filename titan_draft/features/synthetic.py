"""A synthetic target for benchmarks: ``target.flavor = "synthetic:<flavor>"`` (``target.path``
empty). It has the architecture facts of the random-weight ``<flavor>`` of ``target.family``
(hidden size, layers, vocabulary) and returns random captured features of the right shape
instead of running the target: the cost of reading features that are already there, the seam
an offline features source plugs into. Its frozen embedding / lm_head tables are drawn on demand
(``embed_weight``/``lm_head_weight``) and not kept: the draft keeps its own copy, as it would
with a real target.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_draft.protocols.target_spec import TargetBundle, check_capture_layer_ids, random_target_args

__all__ = ["SYNTHETIC_TARGET_PREFIX", "SyntheticTarget", "build_synthetic_target", "is_synthetic_target"]

SYNTHETIC_TARGET_PREFIX = "synthetic:"


def is_synthetic_target(flavor: str) -> bool:
    return flavor.startswith(SYNTHETIC_TARGET_PREFIX)


class SyntheticTarget(nn.Module):
    """Stands in for a frozen target: same ``capture`` / table interface, no parameters.

    ``capture`` returns standard-normal features (fresh ones every call, from a device generator
    seeded once), the cost of reading captured features rather than computing them. ``layers`` is
    empty so that the target's FSDP wrapping has nothing to shard.
    """

    def __init__(self, args: Any, *, seed: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.args = args
        self.seed = seed
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = nn.ModuleDict()
        self._generator = torch.Generator(device=self.device).manual_seed(seed)

    def forward(self, input_ids: torch.Tensor, layer_ids: list[int], need_last_hidden: bool = False):
        bsz, seq = input_ids.shape
        h = self.args.hidden_size
        gen, dtype, dev = self._generator, self.dtype, input_ids.device
        aux = torch.randn(bsz, seq, len(layer_ids) * h, generator=gen, device=dev, dtype=dtype)
        last = torch.randn(bsz, seq, h, generator=gen, device=dev, dtype=dtype) if need_last_hidden else None
        return aux, last

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, layer_ids: list[int], need_last_hidden: bool,
                document_ids: torch.Tensor | None = None):
        """``aux [B, S, len(layer_ids) * H]`` and ``last_hidden [B, S, H]`` or None (random
        features, so packed rows' documents are independent of each other by construction)."""
        check_capture_layer_ids(layer_ids, self.args.num_hidden_layers)
        return self(input_ids, list(layer_ids), need_last_hidden)

    def _table(self, offset: int) -> torch.Tensor:
        # std 1/sqrt(H), as the random-weight targets' tables (logits of std ~1)
        a = self.args
        g = torch.Generator(device=self.device).manual_seed(self.seed + offset)
        t = torch.empty(a.vocab_size, a.hidden_size, device=self.device, dtype=torch.float32)
        return t.normal_(0.0, a.hidden_size**-0.5, generator=g).to(self.dtype)

    def embed_weight(self) -> torch.Tensor:
        """A seeded ``[V, H]`` embedding table, drawn on each call (not kept by the target)."""
        return self._table(0)

    def lm_head_weight(self) -> torch.Tensor:
        """A seeded ``[V, H]`` output table (the embedding's when the flavor ties them)."""
        return self._table(0 if getattr(self.args, "tie_word_embeddings", False) else 1)


def build_synthetic_target(cfg: Any, device: torch.device, dtype: torch.dtype):
    """``TargetBundle`` of ``target.flavor = "synthetic:<flavor>"``, ``<flavor>`` a random-weight
    flavor of ``target.family``."""
    base = cfg.target.flavor[len(SYNTHETIC_TARGET_PREFIX):]
    args = random_target_args(cfg.target.family, base, key=f"target.flavor {cfg.target.flavor!r}")
    model = SyntheticTarget(args, seed=cfg.target.seed, dtype=dtype, device=device)
    return TargetBundle(model=model, args=args, family=cfg.target.family, source=cfg.target.flavor)
