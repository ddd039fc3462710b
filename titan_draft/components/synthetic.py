"""Synthetic data and a synthetic target, for benchmarks: the real training step without files
or a target forward.

Both are selected through the job config, so a benchmark runs exactly the code path of a job:

- ``data.source = "synthetic:<mode>"``: token rows made in memory, fed through the same torchdata
  pipeline (batcher, collate, prefetcher, stateful loader) as conversations. Modes (the seeds'
  synthetic data, SpecForge's ``--variable-mask`` harness):

  - ``fixed``: every sample is ``data.max_length`` tokens, all of them in the loss;
  - ``varmask``: every sample is ``data.max_length`` tokens; a random 20-80 % prefix is prompt
    (out of the loss), so the number of anchor candidates differs between samples;
  - ``varlen``: lengths uniform in ``[max_length / 8, max_length]`` with the same 20-80 %
    prompt prefix (closer to chat data: pad-to-longest batches change shape).

  ``data.max_rows`` is the number of distinct rows per epoch (0: 1024); row ``i`` is drawn from
  a generator seeded with ``(training.seed, i)``, so runs and resumes see the same rows.

- ``target.flavor = "synthetic:<flavor>"`` (with ``target.path`` empty): a target with the
  architecture facts of the random-weight ``<flavor>`` (hidden size, layers, vocabulary) that
  returns random captured features of the right shape instead of running 8B parameters. Its
  frozen embedding / lm_head tables are drawn on demand (``embed_weight``/``lm_head_weight``)
  and not kept: the draft keeps its own copy, as it would with a real target.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torchdata.nodes as tn
from torch import nn

from models.qwen3.model import check_capture_layer_ids
from titan_draft.data.source_node import STATE_KEY, Sample, check_saved_row_count, hashed_seed

__all__ = [
    "SYNTHETIC_MODES",
    "SyntheticSourceNode",
    "SyntheticTarget",
    "build_synthetic_source",
    "build_synthetic_target",
    "is_synthetic_source",
    "is_synthetic_target",
    "synthetic_sample",
]

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_MODES = ("fixed", "varmask", "varlen")
DEFAULT_SYNTHETIC_ROWS = 1024
# The prompt share of a varmask/varlen sample (the seeds' "random 20-80 % prefix").
PROMPT_FRACTION = (0.2, 0.8)
# Ordinary Qwen3 BPE ids (the special tokens, the mask token among them, start at 151643).
_TOKEN_ID_LIMIT = 151643


def is_synthetic_source(source: str) -> bool:
    return source.startswith(SYNTHETIC_PREFIX)


def is_synthetic_target(flavor: str) -> bool:
    return flavor.startswith(SYNTHETIC_PREFIX)


def _synthetic_mode(source: str) -> str:
    mode = source[len(SYNTHETIC_PREFIX):]
    if mode not in SYNTHETIC_MODES:
        raise ValueError(
            f"data.source: {source!r} is not a synthetic source; use one of "
            f"{', '.join(SYNTHETIC_PREFIX + m for m in SYNTHETIC_MODES)}"
        )
    return mode


def synthetic_sample(mode: str, max_length: int, seed: int, row: int, vocab_limit: int = _TOKEN_ID_LIMIT) -> Sample:
    """Row ``row`` of a synthetic source: ``(input_ids, loss_mask)`` as plain lists."""
    g = torch.Generator().manual_seed(hashed_seed("titan_draft.synthetic", seed, row))
    length = max_length
    if mode == "varlen":
        low = max(2, max_length // 8)
        length = int(torch.randint(low, max_length + 1, (1,), generator=g))
    ids = torch.randint(0, vocab_limit, (length,), generator=g).tolist()
    if mode == "fixed":
        return ids, [True] * length
    lo, hi = PROMPT_FRACTION
    fraction = lo + (hi - lo) * float(torch.rand((), generator=g))
    # at least two supervised tokens remain, so every sample has an anchor candidate
    prompt = min(int(fraction * length), length - 2)
    return ids, [False] * prompt + [True] * (length - prompt)


class SyntheticSourceNode(tn.BaseNode[Sample]):
    """Yields this DP rank's synthetic rows, epoch after epoch, forever.

    Its state has the layout of ``ChatSourceNode``'s (epoch, position, skip counts, row count
    under ``STATE_KEY``), so ``ChatDataLoader`` reports and resumes it the same way.

    Args:
        mode: one of ``SYNTHETIC_MODES``.
        num_rows: distinct rows in the whole source (all DP ranks).
        max_length: tokens per sample (the longest sample with ``varlen``).
        seed: row seed (``training.seed``).
        dp_rank, dp_world: rows ``dp_rank, dp_rank + dp_world, ...`` belong to this rank.
    """

    def __init__(self, mode: str, *, num_rows: int, max_length: int, seed: int, dp_rank: int, dp_world: int):
        super().__init__()
        if mode not in SYNTHETIC_MODES:
            raise ValueError(f"synthetic mode {mode!r} is not one of {SYNTHETIC_MODES}")
        self.mode = mode
        self.max_length = max_length
        self.seed = seed
        self.rows = range(dp_rank, num_rows, dp_world)
        """Global indices of this rank's rows (``ChatDataLoader`` counts them)."""
        self._epoch = 0
        self._position = 0

    def reset(self, initial_state: Optional[dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._epoch, self._position = 0, 0
            return
        state = initial_state[STATE_KEY]
        check_saved_row_count(state, len(self.rows), "synthetic source", "data.max_rows")
        self._epoch, self._position = state["epoch"], state["position"]

    def next(self) -> Sample:
        row = self.rows[self._position]
        self._position += 1
        if self._position == len(self.rows):
            self._epoch, self._position = self._epoch + 1, 0
        # every epoch repeats the same rows, like a dataset read again
        return synthetic_sample(self.mode, self.max_length, self.seed, row)

    def get_state(self) -> dict[str, Any]:
        return {
            STATE_KEY: {
                "epoch": self._epoch,
                "position": self._position,
                "skip_counts": {},
                "num_rows": len(self.rows),
            }
        }


def build_synthetic_source(data_cfg: Any, *, dp_rank: int, dp_world: int, seed: int) -> SyntheticSourceNode:
    """This DP rank's source for ``data.source = "synthetic:<mode>"``; ``build_dataloader`` puts
    the job's pipeline (batcher, collate, prefetcher, loader) after it, as after a chat source."""
    mode = _synthetic_mode(data_cfg.source)
    num_rows = data_cfg.max_rows or DEFAULT_SYNTHETIC_ROWS
    if num_rows < dp_world:
        raise ValueError(f"data.max_rows: {num_rows} synthetic rows leave some of the {dp_world} DP ranks with none")
    return SyntheticSourceNode(
        mode, num_rows=num_rows, max_length=data_cfg.max_length, seed=seed, dp_rank=dp_rank, dp_world=dp_world
    )


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
    def capture(self, input_ids: torch.Tensor, layer_ids: list[int], need_last_hidden: bool):
        """``aux [B, S, len(layer_ids) * H]`` and ``last_hidden [B, S, H]`` or None."""
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
    """``TargetBundle`` of ``target.flavor = "synthetic:<flavor>"``, ``<flavor>`` a Qwen3 flavor."""
    from titan_draft.components.target import TargetBundle, random_target_args

    base = cfg.target.flavor[len(SYNTHETIC_PREFIX):]
    args = random_target_args(base, key=f"target.flavor {cfg.target.flavor!r}")
    model = SyntheticTarget(args, seed=cfg.target.seed, dtype=dtype, device=device)
    return TargetBundle(model=model, args=args, family="qwen3", source=cfg.target.flavor)
