"""DSpark draft (block diffusion with the anchor slot predicting, a Markov head and a confidence
head); registers ModelSpec ``dspark``."""

from models.block_diffusion.spec import reserved_tokens, resolved_capture_layers
from models.dspark.args import DSparkArgs, dspark_flavors, update_dspark_args
from models.dspark.export import dspark_from_export, export_dspark
from models.dspark.flops import dspark_flops
from models.dspark.model import DSparkDraft
from models.dspark.parallelize import FLOAT8_SKIP, parallelize_dspark
from models.dspark.proposal import DSparkProposer
from titan_draft.protocols.model_spec import ModelSpec, register_model_spec

register_model_spec(
    ModelSpec(
        name="dspark",
        flavors=dspark_flavors,
        model_cls=DSparkDraft,
        parallelize_fn=parallelize_dspark,
        float8_skip=FLOAT8_SKIP,
        update_args_fn=update_dspark_args,
        capture_layers_fn=resolved_capture_layers,
        reserved_tokens_fn=reserved_tokens,
        export_fn=export_dspark,
        flops_fn=dspark_flops,
        needs_last_hidden=True,
        build_proposer_fn=DSparkProposer,
        from_export_fn=dspark_from_export,
    )
)

__all__ = ["DSparkArgs", "DSparkDraft", "DSparkProposer", "dspark_flavors", "dspark_flops", "export_dspark"]
