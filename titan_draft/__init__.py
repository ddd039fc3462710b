"""titan_draft: PyTorch-native training of speculative-decoding draft models.

Public entry points: :func:`load_target` (a frozen HF Qwen3 / Llama-3 target that captures
hidden states); training runs through ``titan_draft.train`` (``./run_train.sh``).
"""

from titan_draft.features.target import load_target

__all__ = ["load_target"]
