"""The check every draft's export adapter makes of its tensors against the serving contract."""

from __future__ import annotations

import torch

__all__ = ["check_serving_tensors"]


def check_serving_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse ``tensors`` unless they hold exactly the keys of ``shapes``, each of its shape: a key
    SGLang expects and does not find is served silently as its default (a zero bias, the
    target's lm_head), so a partial draft must never pass. KeyError names the keys, ValueError
    the shapes; ``where`` starts the message."""
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise KeyError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")
    wrong = [f"{k}: {tuple(tensors[k].shape)} != {shapes[k]}" for k in sorted(shapes)
             if tuple(tensors[k].shape) != shapes[k]]
    if wrong:
        raise ValueError(f"{where}: shape mismatch: {wrong}")
