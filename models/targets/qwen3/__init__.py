"""Qwen3 frozen target: architecture, HF checkpoint loading, hidden-state capture."""

from models.targets.qwen3.args import Qwen3Args, qwen3_flavors
from models.targets.qwen3.model import Qwen3Model
from models.targets.qwen3.state_dict import (
    hf_key_to_local,
    load_hf_state_dict,
    load_hf_tables,
    local_key_to_hf,
    save_hf_checkpoint,
)
from titan_draft.protocols.target_spec import TargetSpec, register_target_spec

__all__ = [
    "Qwen3Args",
    "Qwen3Model",
    "hf_key_to_local",
    "load_hf_state_dict",
    "load_hf_tables",
    "local_key_to_hf",
    "qwen3_flavors",
    "save_hf_checkpoint",
]

register_target_spec(
    TargetSpec(
        family="qwen3",
        model_types=("qwen3",),
        model_cls=Qwen3Model,
        args_from_hf_config=Qwen3Args.from_hf_config,
        load_hf_state_dict=load_hf_state_dict,
        load_tables=load_hf_tables,
        save_hf_checkpoint=save_hf_checkpoint,
        flavors=qwen3_flavors,
    )
)
