from titan_draft.protocols.features import DraftOutput, TargetFeatures
from titan_draft.protocols.model_spec import ModelSpec, get_model_spec, register_model_spec

__all__ = ["DraftOutput", "TargetFeatures", "ModelSpec", "get_model_spec", "register_model_spec"]
