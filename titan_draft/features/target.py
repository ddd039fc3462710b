"""The frozen target: built from a local HF folder or as a seeded random-weight model, sharded
with FSDP2, run under no_grad to produce ``TargetFeatures``.

Target families register a ``TargetSpec`` for the HF ``model_type`` values they load
(``titan_draft/protocols/target_spec.py``); nothing here names a family.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from titan_draft.components.model_args import user_model_args
from titan_draft.config.job_config import TARGET_BACKENDS
from titan_draft.config.sources import describe_source
from titan_draft.features.synthetic import build_synthetic_target, is_synthetic_target
from titan_draft.protocols import TargetFeatures
from titan_draft.protocols.model_spec import get_model_spec
from titan_draft.protocols.target_spec import (
    TargetBundle,
    get_target_spec,
    random_target_args,
    target_spec_for_model_type,
)

__all__ = ["TargetBundle", "build_target", "build_target_tokenizer", "check_target_config", "compute_features",
           "load_target", "random_target_args", "read_hf_config", "write_random_target"]


def check_target_config(cfg) -> None:
    """Fail before any process group starts when the job cannot get a target or its tokenizer."""
    t = cfg.target
    where = describe_source(cfg, "target.path")  # the command line or the job file that set it
    if t.path:
        if not os.path.isdir(t.path):
            raise ValueError(
                f"target.path: {t.path!r} does not exist or is not a folder{where} (for a small "
                f"random-weight test target: python scripts/write_random_target.py --out {t.path})"
            )
        hf_config = read_hf_config(t.path, backend=t.backend)
        if t.backend == "transformers":
            import importlib.util

            if importlib.util.find_spec("transformers") is None:  # before any process group starts
                raise ValueError("target.backend = 'transformers' needs the transformers package: "
                                 "pip install transformers")
            check_job = get_target_spec("transformers").check_job
            if check_job is not None:  # the draft's needs decide what serving must match
                spec = get_model_spec(cfg.model.name)
                check_job(hf_config, needs_teacher=spec.needs_last_hidden_for(user_model_args(spec, cfg)))
            hf_config = hf_config.get("text_config") or hf_config
        build_target_tokenizer(cfg, hf_config.get("vocab_size", 0))  # cached for the trainer
    elif not t.flavor:
        raise ValueError(
            f"target.path is required by this job{where}: pass --target.path /path/to/hf_checkpoint_folder "
            "(or --target.flavor NAME for a random-weight target, for benchmarks only)"
        )


def build_target_tokenizer(cfg, vocab_size: int):
    """The target's tokenizer: ``target.tokenizer``, else the files in ``target.path``, else the
    packaged Qwen3 BPE (random-weight targets are Qwen3-shaped). ``vocab_size`` is the target's
    embedding rows; a tokenizer with more ids than that belongs to another model."""
    from titan_draft.data.tokenizer import build_tokenizer

    t = cfg.target
    key, spec = ("target.tokenizer", t.tokenizer) if t.tokenizer else (
        ("target.path", t.path) if t.path else ("target.tokenizer", "qwen3"))
    try:
        tokenizer = build_tokenizer(spec)
    except ValueError as e:
        hint = " (or point target.tokenizer at the tokenizer files)" if key == "target.path" else ""
        raise ValueError(f"{key}: {e}{hint}") from None
    if vocab_size and tokenizer.n_vocab > vocab_size:
        raise ValueError(
            f"{key}: tokenizer {tokenizer.name!r} has {tokenizer.n_vocab} ids but the target has "
            f"{vocab_size} embedding rows; they do not belong to the same model"
        )
    return tokenizer


def read_hf_config(folder: str, backend: str = "native") -> dict:
    """config.json of an HF checkpoint folder whose model_type a target family supports and
    whose optional features (quantization, sliding window, biases) that family implements
    (``backend='transformers'``: any folder, transformers runs what it says)."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"target.path: {folder!r} has no config.json (expected an HF checkpoint folder)")
    with open(cfg_path) as f:
        hf_config = json.load(f)
    if backend == "transformers":
        return hf_config
    spec = target_spec_for_model_type(hf_config.get("model_type"), cfg_path)
    _check_supported(hf_config, cfg_path, spec)
    return hf_config


# config.json switches that change what a decoder computes; a family lists those it implements
_FEATURES = {
    "attention_bias": "sets attention_bias=true",
    "mlp_bias": "sets mlp_bias=true",
    "use_sliding_window": "enables sliding-window attention",
}


def _check_supported(hf_config: dict, cfg_path: str, spec) -> None:
    """Refuse config.json features the family's modules do not implement (they would load and
    then compute something else than the served model)."""
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"target.path: {cfg_path} is a quantized checkpoint ({method}); "
                         "use the unquantized (bf16) weights")
    for key, what in _FEATURES.items():
        if hf_config.get(key) and key not in spec.config_features:
            raise ValueError(f"target.path: {cfg_path} {what}, which the {spec.family} target "
                             "family does not implement")


def _resolve_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _freeze_and_place(model: nn.Module, device: torch.device, dtype: torch.dtype, mesh) -> None:
    """Freeze a meta-device model, shard it over ``mesh`` (if given) and allocate it on
    ``device``: with a mesh each rank allocates only its shard."""
    model.to(dtype)
    model.requires_grad_(False)
    model.eval()
    # one rank holds everything anyway: sharding over it would only add hooks to every forward
    # and DTensor parameters, which rule out the eval's CUDA graphs
    if mesh is not None and mesh.size() > 1:
        from titan_draft.distributed.parallelize import apply_fsdp_frozen

        apply_fsdp_frozen(model, mesh, blocks=model.layers, param_dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()


def load_target(path: str, *, dtype: torch.dtype = torch.bfloat16, device="cpu", mesh=None,
                backend: str = "native") -> nn.Module:
    """Load a frozen target from a local HF checkpoint folder.

    Reads ``config.json``, picks the family from ``model_type`` (``qwen3``, ``llama``, ``qwen2``, ``qwen3_moe``), builds
    the model on the meta device and loads ``model.safetensors`` or the shards listed in
    ``model.safetensors.index.json``. Every key and shape is checked before any weight is copied.

    Args:
        path: folder with ``config.json`` and the safetensors weights.
        dtype: parameter dtype (checkpoint tensors are cast to it).
        device: where the parameters live.
        mesh: a 1-D DeviceMesh to shard the target over with FSDP2 (``fully_shard`` per decoder
            layer, then the root). Each rank then allocates and reads from disk only its own
            rows of every tensor: the full model is never materialized on one rank.
        backend: 'native' (the family registered for the folder's model_type) or
            'transformers' (the registered backend that runs any AutoModelForCausalLM folder
            through transformers; it reads the whole folder on each rank, then shards).

    Returns:
        The frozen model (eval mode, ``requires_grad=False``). ``model.capture(input_ids,
        layer_ids)`` returns ``(aux, last_hidden)``: the outputs of the decoder layers in
        ``layer_ids`` concatenated on the last dim, id ``i`` being the output of decoder layer
        ``i`` (0-based, SGLang's convention; HF ``hidden_states[i + 1]``), and the final-norm
        last hidden state. ``model.args`` holds the architecture, ``model.family`` the family.

    Raises:
        ValueError: the folder, its config or a tensor shape is not something we support.
        FileNotFoundError: config.json, the weights or a shard listed in the index is missing.
        KeyError: unexpected, missing or doubly stored keys (naming the key and the file).
    """
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        raise ValueError(f"target.path: {path!r} does not exist or is not a folder")
    if backend == "transformers":
        # by its registered name: the engine does not import the backend's package
        return get_target_spec("transformers").load_folder(folder, dtype=dtype, device=_resolve_device(device), mesh=mesh)
    if backend != "native":
        raise ValueError(f"target.backend: {backend!r} is not one of {', '.join(TARGET_BACKENDS)}")
    hf_config = read_hf_config(folder)
    spec = target_spec_for_model_type(hf_config["model_type"], os.path.join(folder, "config.json"))
    args = spec.args_from_hf_config(hf_config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    _freeze_and_place(model, _resolve_device(device), dtype, mesh)
    spec.load_hf_state_dict(model, folder)
    model.family = spec.family
    return model


def build_target(cfg, device: torch.device, dtype: torch.dtype, mesh=None) -> TargetBundle:
    """The job's frozen target on ``device`` in ``dtype``: loaded from ``target.path``, or a
    seeded random-weight ``target.flavor``; sharded over ``mesh`` when one is given."""
    tcfg = cfg.target
    if is_synthetic_target(tcfg.flavor) and not tcfg.path:  # benchmarks: random captured features, no forward
        return build_synthetic_target(cfg, device, dtype)
    if tcfg.path:
        model = load_target(tcfg.path, dtype=dtype, device=device, mesh=mesh, backend=tcfg.backend)
        bundle = TargetBundle(model=model, args=model.args, family=model.family, source=tcfg.path)
    else:
        args = random_target_args(tcfg.family, tcfg.flavor)
        with torch.device("meta"):
            model = get_target_spec(tcfg.family).model_cls(args)
        _freeze_and_place(model, _resolve_device(device), dtype, mesh)
        # drawn in fp32 and cast, so a random target has the same values in every dtype
        model.init_weights(seed=tcfg.seed)
        bundle = TargetBundle(model=model, args=args, family=tcfg.family, source=f"random:{tcfg.flavor}")
    if cfg.compile.enable and cfg.compile.target:
        bundle.model.compile_capture(cfg.compile.backend)
        bundle.compiled = True
    return bundle


@torch.no_grad()
def compute_features(
    target: nn.Module, batch: dict[str, torch.Tensor], layer_ids: list[int], need_last_hidden: bool
) -> TargetFeatures:
    """Run the frozen target on one micro-batch (already on device)."""
    document_ids = batch.get("document_ids")  # packed rows (data.packing)
    aux, last = target.capture(batch["input_ids"], layer_ids, need_last_hidden, document_ids=document_ids)
    return TargetFeatures(
        input_ids=batch["input_ids"],
        loss_mask=batch["loss_mask"],
        valid_lengths=batch["valid_lengths"],
        aux_hidden=aux,
        last_hidden=last,
        document_ids=document_ids,
    )


def write_random_target(folder: str, *, flavor: str = "debugmodel", seed: int = 1234,
                        dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 0) -> str:
    """Write a random-weight Qwen3 target as an HF folder that :func:`load_target` (and
    transformers) read like a real checkpoint: ``config.json``, safetensors weights (sharded
    with an index past ``max_shard_bytes``), and the Qwen3 tokenizer (``tokenizer.json`` and
    ``tokenizer_config.json`` built from the Qwen BPE ranks).

    The weights are those of the ``random:<flavor>`` target with the same ``seed`` (drawn on
    CPU), cast to ``dtype``. Returns ``folder``.
    """
    from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
    from titan_draft.data.tokenizer import build_tokenizer

    spec = get_target_spec("qwen3")  # the Qwen BPE below is a Qwen3 tokenizer
    args = random_target_args("qwen3", flavor, key="flavor")
    model = spec.model_cls(args)
    model.init_weights(seed=seed)
    os.makedirs(folder, exist_ok=True)
    spec.save_hf_checkpoint(model, folder, dtype=dtype, max_shard_bytes=max_shard_bytes)
    tokenizer = build_tokenizer("qwen3")
    save_hf_tokenizer(tokenizer, folder)
    hf_config = args.to_hf_config(torch_dtype=str(dtype).removeprefix("torch."))
    # as Qwen3's own config.json: bos <|endoftext|>, eos the tokenizer's (<|im_end|>)
    hf_config.update(bos_token_id=tokenizer.token_id("<|endoftext|>"),
                     eos_token_id=tokenizer.token_id(tokenizer.eos_token))
    # config.json last: its presence is what marks the folder complete
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    return folder
