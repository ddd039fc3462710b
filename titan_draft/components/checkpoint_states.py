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

    The state is pickled to bytes: DCP would otherwise flatten it and drop empty containers.
    """

    def __init__(self, dataloader: Any, dp_rank: int, dp_world: int) -> None:
        self.dataloader = dataloader
        self.dp_rank = dp_rank
        self.dp_world = dp_world

    @property
    def rank_key(self) -> str:
        return f"dp_rank_{self.dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        return {
            self.rank_key: pickle.dumps(self.dataloader.state_dict()),
            "dp_world": self.dp_world,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataloader.load_state_dict(pickle.loads(state_dict[self.rank_key]))
