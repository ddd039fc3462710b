"""The Stateful wrappers of what a checkpoint holds (see checkpoint.py for the layout)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """The trainer's counters that must survive a resume."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ModelWrapper(Stateful):
    """Exposes a (possibly compiled / AC-wrapped / FSDP2-sharded) model through clean FQNs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


class OptimizerWrapper(Stateful):
    """Optimizer state keyed by parameter FQN (flattened), so it is independent of param order."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        # On a fresh optimizer this first materializes exp_avg/exp_avg_sq (a zero-lr step), which
        # gives DCP the tensors to load into.
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state_dict=state_dict, options=self._OPTIONS
        )


class DataLoaderWrapper(Stateful):
    """One DP rank's dataloader state under ``dp_rank_{r}``, plus the DP size under ``dp_world``.

    The state is pickled to bytes: DCP would otherwise flatten it and drop empty containers. For a
    checkpoint of another DP size (``saved_world``, set by the manager before the load) it asks DCP
    for every saved rank's entry and hands the dataloader their states merged into one dict: a
    dataloader state keeps each rank's part under a key of its own and the DP size under
    ``world_size`` (data/loader_state.py), so the merge loses nothing, and the dataloader decides
    whether its position can move to this DP size. The load itself runs in ``apply``, after DCP,
    so that a refusal is the dataloader's own line rather than one of DCP's per-rank failures.
    """

    def __init__(self, dataloader: Any, dp_rank: int, dp_world: int) -> None:
        self.dataloader = dataloader
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.saved_world: int | None = None
        self._loaded: Any = None

    @property
    def rank_key(self) -> str:
        return f"dp_rank_{self.dp_rank}"

    def _load_keys(self) -> list[str]:
        if self.saved_world is None or self.saved_world == self.dp_world:
            return [self.rank_key]
        return [f"dp_rank_{r}" for r in range(self.saved_world)]

    def state_dict(self) -> dict[str, Any]:
        if self.saved_world is not None:  # the structure DCP loads into: the entries to read
            return {**{k: b"" for k in self._load_keys()}, "dp_world": self.saved_world}
        return {
            self.rank_key: pickle.dumps(self.dataloader.state_dict()),
            "dp_world": self.dp_world,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict

    def apply(self) -> None:
        """Load what DCP read into the dataloader (raises the dataloader's refusal)."""
        loaded, self._loaded, keys = self._loaded, None, self._load_keys()
        self.saved_world = None  # saves write this run's layout again
        if len(keys) == 1:
            self.dataloader.load_state_dict(pickle.loads(loaded[keys[0]]))
            return
        merged: dict[str, Any] = {}
        for k in keys:
            part = pickle.loads(loaded[k])
            shared = sorted(set(part) & set(merged) - {"world_size"})
            if shared:  # a loader without per-rank keys: merging would keep one rank's position
                raise ValueError(
                    f"data: the dataloader states of the {len(keys)} saved DP ranks share the keys {shared}, so they "
                    f"cannot be merged to move the position to {self.dp_world} DP ranks; resume with {len(keys)} DP "
                    "ranks, or set checkpoint.reset_data_position = true")
            merged.update(part)
        self.dataloader.load_state_dict(merged)
