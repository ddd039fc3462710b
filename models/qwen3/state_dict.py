"""HF checkpoint <-> Qwen3Model key mapping and safetensors loading."""

from __future__ import annotations

import json
import os
from collections import Counter

import torch
from safetensors import safe_open

from models.common import copy_full_

# Buffers that some older HF checkpoints saved; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_key_to_local(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``; ``lm_head.*``
    is kept. Any other key is returned unchanged (and will be reported as unexpected)."""
    return name[len("model.") :] if name.startswith("model.") else name


def local_key_to_hf(name: str) -> str:
    """Inverse of :func:`hf_key_to_local`."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def _checkpoint_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: missing or empty 'weight_map'")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{index} lists {os.path.basename(path)!r}, which is missing"
                )
        return files
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in target folder {folder!r}"
    )


@torch.no_grad()
def load_hf_state_dict(model: torch.nn.Module, folder: str) -> None:
    """Load an HF Qwen3 checkpoint folder into ``model`` (plain or FSDP2-sharded parameters).

    Every key and shape is checked before anything is copied, so a bad checkpoint leaves the
    model untouched. Raises ``KeyError`` naming unexpected/missing keys (and the file), and
    ``ValueError`` naming a key whose shape differs. With tied embeddings ``lm_head.weight`` is
    the embedding and a stored ``lm_head.weight`` is ignored.
    """
    tied = bool(getattr(model.args, "tie_word_embeddings", False))
    if tied:
        # meta init + to_empty gives lm_head its own (empty) storage: tie it again
        model.lm_head.weight = model.embed_tokens.weight
    expected = dict(model.state_dict())
    if tied:
        expected.pop("lm_head.weight", None)

    plan: list[tuple[str, str, str]] = []  # (file, hf key, local key)
    for path in _checkpoint_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                local = hf_key_to_local(key)
                if tied and local == "lm_head.weight":
                    continue
                if local not in expected:
                    raise KeyError(f"unexpected key {key!r} in {path}")
                shape = tuple(f.get_slice(key).get_shape())
                want = tuple(expected[local].shape)
                if shape != want:
                    raise ValueError(
                        f"shape mismatch for {key!r} in {path}: checkpoint {shape}, model {want}"
                    )
                plan.append((path, key, local))
    seen = Counter(local for _, _, local in plan)
    duplicates = sorted(k for k, c in seen.items() if c > 1)
    if duplicates:
        raise KeyError(
            f"keys stored more than once in {folder}: {[local_key_to_hf(k) for k in duplicates]}"
        )
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise KeyError(f"missing keys in {folder}: {[local_key_to_hf(k) for k in missing]}")

    for path in sorted({p for p, _, _ in plan}):
        with safe_open(path, framework="pt", device="cpu") as f:
            for p, key, local in plan:
                if p == path:
                    copy_full_(expected[local], f.get_tensor(key))
