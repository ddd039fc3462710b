"""The transformers backend (``target.backend = "transformers"``): any ``AutoModelForCausalLM``
folder as a frozen target, for the families that have no native code here (Mistral, Gemma, Phi,
...). transformers is imported only when such a target is built."""

from __future__ import annotations

from models.targets.hf.args import HFTargetArgs
from models.targets.hf.model import HFTarget, load_hf_target
from models.targets.hf.serving import check_serving_conventions
from models.targets.hf.tables import load_hf_tables
from titan_draft.protocols.target_spec import TargetSpec, register_target_spec

FAMILY = "transformers"


def _no_state_dict(model, folder):  # from_pretrained reads the weights itself
    raise NotImplementedError("the transformers backend loads its weights with from_pretrained")


register_target_spec(
    TargetSpec(
        family=FAMILY,
        model_types=(),  # never picked by model_type: only target.backend = "transformers" selects it
        model_cls=HFTarget,
        args_from_hf_config=HFTargetArgs.from_hf_config,
        load_hf_state_dict=_no_state_dict,
        load_folder=load_hf_target,
        load_tables=load_hf_tables,
        check_job=check_serving_conventions,
    )
)

__all__ = ["FAMILY", "HFTarget", "HFTargetArgs", "load_hf_target"]
