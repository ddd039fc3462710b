"""DFlash2 draft (and plain DFlash via the dflash_* flavors); registers ModelSpec ``dflash2``."""

from models.block_diffusion.spec import block_capture_layers as capture_layers
from models.block_diffusion.spec import reserved_tokens, resolved_capture_layers
from models.dflash2.args import DFlash2Args, dflash2_flavors, reads_last_hidden, update_dflash2_args
from models.dflash2.export import dflash2_from_export, export_dflash2
from models.dflash2.flops import dflash2_flops
from models.dflash2.model import DFlash2Draft
from models.dflash2.parallelize import FLOAT8_SKIP, parallelize_dflash2
from models.dflash2.proposal import DFlashProposer
from titan_draft.protocols.model_spec import ModelSpec, register_model_spec

register_model_spec(
    ModelSpec(
        name="dflash2",
        flavors=dflash2_flavors,
        model_cls=DFlash2Draft,
        parallelize_fn=parallelize_dflash2,
        float8_skip=FLOAT8_SKIP,
        update_args_fn=update_dflash2_args,
        capture_layers_fn=resolved_capture_layers,
        reserved_tokens_fn=reserved_tokens,
        export_fn=export_dflash2,
        flops_fn=dflash2_flops,
        needs_last_hidden=False,
        needs_last_hidden_fn=reads_last_hidden,
        build_proposer_fn=DFlashProposer,
        from_export_fn=dflash2_from_export,
    )
)

__all__ = [
    "DFlash2Args",
    "DFlash2Draft",
    "DFlashProposer",
    "capture_layers",
    "dflash2_flavors",
    "dflash2_flops",
    "export_dflash2",
]
