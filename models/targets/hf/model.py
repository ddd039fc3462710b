"""A frozen target run by transformers: the folder's own ``AutoModelForCausalLM`` behind the
target interface of ``titan_draft/protocols/target_spec.py``.

Capture calls the decoder (the base model), never the LM head, and reads the configured layers'
outputs through forward hooks. Decoding keeps transformers' own ``DynamicCache``, so the eval
decodes with exactly the family's attention (sliding windows, soft-capping) and logit head.
Packed rows are refused: a family's attention may ignore a custom 4D mask (sliding windows,
flash kernels), so the capture would silently cross documents.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os

import torch
from torch import nn

from models.common import full_tensor
from models.targets.hf.args import HFTargetArgs
from models.targets.hf.cache import HFDecodeCache
from models.targets.hf.serving import attention_kernel, check_serving_conventions
from models.targets.hf.sharded import (
    allocate_keeping_buffers,
    load_sharded_parameters,
    params_on_meta,
)
from models.targets.qwen3.cache import DecodeStep
from titan_draft.protocols.target_spec import check_capture_layer_ids

logger = logging.getLogger(__name__)

PACKING_REFUSED = ("target.backend = 'transformers' does not capture packed rows (document_ids): "
                   "set data.packing = false or use a native target family")


def import_transformers():
    """transformers, or a ValueError naming the install: it is an optional dependency."""
    try:
        import transformers
    except ImportError:
        raise ValueError("target.backend = 'transformers' needs the transformers package: "
                         "pip install transformers") from None
    return transformers


def find_decoder_layers(decoder: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder's ModuleList of its ``num_layers`` blocks (``model.layers`` in nearly every
    family; otherwise the first ModuleList of that length)."""
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for _, module in decoder.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"target: {type(decoder).__name__} has no ModuleList of its {num_layers} decoder layers")


def _layer_output(output):
    # families differ: a tensor, or a tuple whose first entry is the hidden states
    return output[0] if isinstance(output, (tuple, list)) else output


class HFTarget(nn.Module):
    """``hf``: a loaded ``*ForCausalLM``; ``args``: its :class:`HFTargetArgs`."""

    cuda_graphs = False
    cuda_graphs_why = ("the transformers backend runs eagerly: its DynamicCache grows by concatenation and "
                       "its forward is not checked to be capturable")

    def __init__(self, hf: nn.Module, args: HFTargetArgs):
        super().__init__()
        self.hf = hf
        self.args = args
        self.family = "transformers"
        # held outside the module tree: both are already submodules of ``hf``
        self._refs = {"decoder": hf.get_decoder()}
        self._refs["blocks"] = find_decoder_layers(self._refs["decoder"], args.num_hidden_layers)
        self._record: dict | None = None
        for i, layer in enumerate(self._refs["blocks"]):
            layer.register_forward_hook(self._layer_hook(i))
        self._refs["decoder"].register_forward_hook(self._decoder_hook)
        params = inspect.signature(self._refs["decoder"].forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The decoder blocks by index (what FSDP shards one by one)."""
        return {str(i): layer for i, layer in enumerate(self._refs["blocks"])}

    def _layer_hook(self, i: int):
        def hook(module, args, output):
            if self._record is not None and i in self._record["wanted"]:
                self._record[i] = _layer_output(output)
        return hook

    def _decoder_hook(self, module, args, output):
        if self._record is not None:
            self._record["last"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    @contextlib.contextmanager
    def _recording(self, layer_ids):
        self._record = {"wanted": set(layer_ids)}
        try:
            yield self._record
        finally:
            self._record = None

    def tie_weights(self) -> None:
        """transformers ties the tables itself when it loads the folder."""

    def init_weights(self, seed: int) -> None:
        raise ValueError("target.backend = 'transformers' loads a checkpoint folder; it has no random-weight flavors")

    def compile_capture(self, backend: str = "inductor") -> None:
        """Compile each decoder block in place (FQNs unchanged); decoding runs the same blocks."""
        for layer in self._refs["blocks"]:
            layer.compile(backend=backend)

    def forward(self, input_ids: torch.Tensor, layer_ids: list[int] | None = None, need_last_hidden: bool = True,
                *, cache: HFDecodeCache | None = None, logits: str = "all", document_ids: torch.Tensor | None = None):
        """As the native targets' forward: logits ``[B, S, V]`` without ``layer_ids``, ``(aux,
        last_hidden | None)`` with them, a :class:`DecodeStep` with ``cache``. Runs through
        this module so that FSDP2's root hooks gather the tables."""
        if document_ids is not None:
            raise ValueError(PACKING_REFUSED)
        if cache is not None:
            return self._decode(input_ids, layer_ids, need_last_hidden, cache, logits)
        if layer_ids is None:
            return self.hf(input_ids=input_ids, use_cache=False).logits
        with self._recording(layer_ids) as rec:
            self._refs["decoder"](input_ids=input_ids, use_cache=False)
        aux = torch.cat([rec[i] for i in layer_ids], dim=-1)
        return aux, (rec["last"] if need_last_hidden else None)

    def _decode(self, input_ids, layer_ids, need_last_hidden, cache: HFDecodeCache, logits: str) -> DecodeStep:
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        num_new = input_ids.shape[1]
        cache.check_room(num_new)
        kwargs = {"input_ids": input_ids, "use_cache": True, self._cache_kw: cache.dynamic}
        if cache.pad is not None:
            kwargs.update(position_ids=cache.positions(num_new), attention_mask=cache.attention_mask(num_new))
        out_logits = None
        with self._recording(layer_ids or ()) as rec:
            if logits == "none":
                self._refs["decoder"](**kwargs)
            else:  # the family's own head (soft-capping, logit scales) on the rows asked for
                out = self.hf(**kwargs, logits_to_keep=1 if logits == "last" else 0)
                out_logits = out.logits.float()
        cache.advance(num_new)
        aux = torch.cat([rec[i] for i in layer_ids], dim=-1) if layer_ids else None
        return DecodeStep(logits=out_logits, aux=aux, last_hidden=rec["last"] if need_last_hidden else None)

    def new_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None, static: bool = False) -> HFDecodeCache:
        """An empty cache of ``batch`` rows of up to ``max_len`` tokens (``pad``: left-padding
        per row). No static form: CUDA-graph decoding needs a native target."""
        if static:
            raise ValueError("target.backend = 'transformers' decodes with transformers' DynamicCache, which "
                             "CUDA graphs cannot replay: run the eval with --no-cuda-graphs")
        transformers = import_transformers()
        device = full_tensor(self.hf.get_input_embeddings().weight).device
        return HFDecodeCache(transformers.DynamicCache(), batch, max_len, pad=pad, device=device)

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, layer_ids: list[int], need_last_hidden: bool = True,
                document_ids: torch.Tensor | None = None):
        """``(aux [B, S, K*H], last_hidden [B, S, H] | None)``: id ``i`` is decoder layer ``i``'s
        output (HF ``hidden_states[i + 1]``), ``last_hidden`` the decoder's final-norm output."""
        check_capture_layer_ids(layer_ids, self.args.num_hidden_layers)
        return self(input_ids, layer_ids=list(layer_ids), need_last_hidden=need_last_hidden, document_ids=document_ids)

    def embed_weight(self) -> torch.Tensor:
        """The full ``[V, H]`` input embedding (all-gathered if sharded), detached."""
        return full_tensor(self.hf.get_input_embeddings().weight).detach()

    def lm_head_weight(self) -> torch.Tensor:
        """The full ``[V, H]`` output projection (all-gathered if sharded), detached."""
        return full_tensor(self.hf.get_output_embeddings().weight).detach()


def load_hf_target(folder: str, *, dtype: torch.dtype, device, mesh=None) -> HFTarget:
    """Load ``folder`` with ``AutoModelForCausalLM`` (local files only), freeze it, shard its
    decoder layers over ``mesh`` (FSDP2, when it spans several ranks) and place it on ``device``."""
    import json

    transformers = import_transformers()
    with open(os.path.join(folder, "config.json")) as f:
        hf_config = json.load(f)
    args = HFTargetArgs.from_hf_config(hf_config)
    check_serving_conventions(hf_config)
    sharded = mesh is not None and mesh.size() > 1
    try:
        # the family's default attention kernel, but by name where only one computes the family
        kernel = {"attn_implementation": k} if (k := attention_kernel(hf_config)) else {}
        if sharded:  # parameters on meta: each rank reads only its rows below
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
            with params_on_meta():
                hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **kernel)
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **kernel)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"target.path: transformers cannot load {folder}: {first}") from None
    hf.requires_grad_(False)
    hf.eval()
    model = HFTarget(hf, args)
    if sharded:
        from titan_draft.distributed.parallelize import apply_fsdp_frozen

        apply_fsdp_frozen(model, mesh, blocks=model.layers, param_dtype=dtype)
        allocate_keeping_buffers(model, device)
        load_sharded_parameters(hf, folder)
    model.to(device)
    logger.info("target: %s (%s) through transformers, attention %s, %d layers", folder, args.model_type,
                hf.config._attn_implementation, args.num_hidden_layers)
    return model
