"""Qwen3 frozen target: architecture, HF checkpoint loading, hidden-state capture."""

from models.qwen3.args import Qwen3Args, qwen3_flavors
from models.qwen3.model import Qwen3Model
from models.qwen3.state_dict import (
    hf_key_to_local,
    load_hf_state_dict,
    local_key_to_hf,
    save_hf_checkpoint,
)

__all__ = [
    "Qwen3Args",
    "Qwen3Model",
    "hf_key_to_local",
    "load_hf_state_dict",
    "local_key_to_hf",
    "qwen3_flavors",
    "save_hf_checkpoint",
]

# The target-family interface that titan_draft.components.target looks up by name.
TARGET_FLAVORS = qwen3_flavors
TARGET_MODEL_CLS = Qwen3Model
args_from_hf_config = Qwen3Args.from_hf_config
