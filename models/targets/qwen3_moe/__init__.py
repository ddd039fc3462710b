"""Qwen3-MoE frozen target (HF ``model_type`` ``qwen3_moe``, e.g. Qwen3-30B-A3B)."""

from models.targets.qwen3.state_dict import load_hf_tables
from models.targets.qwen3_moe.args import Qwen3MoeArgs, qwen3_moe_flavors
from models.targets.qwen3_moe.model import Qwen3MoeModel
from models.targets.qwen3_moe.state_dict import load_moe_state_dict, save_moe_checkpoint
from titan_draft.protocols.target_spec import TargetSpec, register_target_spec

__all__ = ["Qwen3MoeArgs", "Qwen3MoeModel", "load_moe_state_dict", "qwen3_moe_flavors", "save_moe_checkpoint"]

register_target_spec(
    TargetSpec(
        family="qwen3_moe",
        model_types=("qwen3_moe",),
        model_cls=Qwen3MoeModel,
        args_from_hf_config=Qwen3MoeArgs.from_hf_config,
        load_hf_state_dict=load_moe_state_dict,
        load_tables=load_hf_tables,
        save_hf_checkpoint=save_moe_checkpoint,
        flavors=qwen3_moe_flavors,
    )
)
