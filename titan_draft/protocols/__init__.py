from titan_draft.protocols.features import DraftOutput, TargetFeatures
from titan_draft.protocols.model_spec import (
    ArgsContext,
    ModelSpec,
    PrepareContext,
    get_model_spec,
    register_model_spec,
)

__all__ = ["ArgsContext", "DraftOutput", "PrepareContext", "TargetFeatures", "ModelSpec", "get_model_spec", "register_model_spec"]
