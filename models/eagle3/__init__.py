"""EAGLE-3 draft (one decoder layer on fused target features, training-time test); registers
ModelSpec ``eagle3``."""

from models.eagle3.args import Eagle3Args, eagle3_capture_layers, eagle3_flavors, update_eagle3_args
from models.eagle3.export import eagle3_from_export, export_eagle3
from models.eagle3.model import Eagle3Draft
from models.eagle3.parallelize import FLOAT8_SKIP, parallelize_eagle3
from models.eagle3.prepare import prepare_eagle3
from models.eagle3.proposal import Eagle3Proposer
from models.eagle3.flops import eagle3_flops
from titan_draft.protocols.model_spec import ModelSpec, register_model_spec

register_model_spec(
    ModelSpec(
        name="eagle3",
        flavors=eagle3_flavors,
        model_cls=Eagle3Draft,
        parallelize_fn=parallelize_eagle3,
        update_args_fn=update_eagle3_args,
        capture_layers_fn=lambda args: list(args.target_layer_ids),
        export_fn=export_eagle3,
        needs_last_hidden=True,
        prepare_fn=prepare_eagle3,
        float8_skip=FLOAT8_SKIP,
        build_proposer_fn=Eagle3Proposer,
        from_export_fn=eagle3_from_export,
        flops_fn=eagle3_flops,
    )
)

__all__ = ["Eagle3Args", "Eagle3Draft", "Eagle3Proposer", "eagle3_capture_layers", "eagle3_flavors", "eagle3_flops"]
