"""Float8 training of the draft's Linears with torchao (tensorwise dynamic scaling).

Applied by the trainer to the whole draft before its ``parallelize_fn`` (AC, compile,
``fully_shard``: torchtitan's order): ``Float8Converter.convert`` swaps eligible ``nn.Linear`` for
torchao ``Float8Linear``, leaving the modules the draft's spec keeps in high precision
(``ModelSpec.float8_skip``) and ``float8.filter_fqns``; ``post_optimizer_hook`` precomputes the
float8 weight scales for FSDP2's float8 all-gather.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from titan_draft.distributed.utils import select_device_type

logger = logging.getLogger(__name__)

# float8 GEMMs (torch._scaled_mm) need both weight dims to be multiples of 16
_FP8_ALIGN = 16


def _probe_cpu_scaled_mm() -> str | None:
    """None if real float8 matmuls run on this CPU, else the reason they don't."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except Exception as e:  # any failure means: no float8 kernel here
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


class Float8Converter:
    """Converts the trainable Linears of a module to float8 and tracks what it did.

    ``describe()`` is what the run prints at start and saves next to its checkpoints.
    """

    def __init__(self, job_config: Any, parallel_dims: Any = None):
        f8 = job_config.float8
        self.enabled: bool = f8.enable
        self.filter_fqns: list[str] = list(f8.filter_fqns)
        self.precompute_scales: bool = f8.precompute_float8_dynamic_scale_for_fsdp
        self.dp_size: int = parallel_dims.dp_shard if parallel_dims is not None else 1
        # the float8 all-gather is an FSDP feature: with one shard there is nothing to gather
        self.enable_fsdp_float8_all_gather: bool = f8.enable_fsdp_float8_all_gather and self.dp_size > 1
        self.all_gather_off_reason: str | None = (
            "one DP shard" if f8.enable_fsdp_float8_all_gather and self.dp_size == 1 else None)
        self.emulate: bool = f8.emulate
        self.emulate_reason: str | None = "float8.emulate = true" if f8.emulate else None
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}
        self._any_float8_all_gather = False
        if self.enabled:
            self._check_support(select_device_type(job_config.job.device))

    def _check_support(self, device_type: str) -> None:
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"float8.enable needs torchao (pip install torchao): {e}") from None
        if self.emulate:
            logger.warning("float8: EMULATED (float8.emulate = true): matmuls run in high precision "
                           "on float8-rounded operands; numerics only, no speed-up")
            return
        if device_type == "cuda":
            cap = torch.cuda.get_device_capability()
            if cap < (8, 9):
                raise RuntimeError(f"float8.enable needs a GPU with float8 tensor cores (sm_89+), "
                                   f"this one is sm_{cap[0]}{cap[1]}; set float8.emulate = true "
                                   "to test the numerics without them")
            return
        reason = _probe_cpu_scaled_mm()
        if reason is not None:
            # only on CPU, and said loudly: CPU float8 is for tests, never for speed
            self.emulate = True
            self.emulate_reason = f"torch._scaled_mm does not run on this CPU ({reason})"
            logger.warning("float8: real float8 matmuls unavailable on CPU, EMULATING instead: %s",
                           self.emulate_reason)

    def _skip_reason(self, module: nn.Linear, fqn: str, keep: tuple[str, ...]) -> str | None:
        if not module.weight.requires_grad:
            return "frozen"
        for prefix in keep:
            if fqn == prefix or fqn.startswith(prefix + "."):
                return f"kept in high precision by the draft ('{prefix}')"
        out_features, in_features = module.weight.shape
        if out_features % _FP8_ALIGN or in_features % _FP8_ALIGN:
            return f"shape ({out_features}, {in_features}) not divisible by {_FP8_ALIGN}"
        for pattern in self.filter_fqns:
            if pattern in fqn:
                return f"float8.filter_fqns '{pattern}'"
        return None

    def convert(self, module: nn.Module, fqn_prefix: str = "", keep: tuple[str, ...] = ()) -> nn.Module:
        """Swap the eligible ``nn.Linear`` in ``module`` (in place) for ``Float8Linear``.
        ``fqn_prefix`` is ``module``'s own FQN in the model, so filter_fqns match full names;
        ``keep`` are FQNs (modules and everything under them) that stay in high precision."""
        if not self.enabled:
            return module
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        prefix = f"{fqn_prefix}." if fqn_prefix and not fqn_prefix.endswith(".") else fqn_prefix
        eligible: dict[int, tuple[str, nn.Linear]] = {}
        for name, mod in module.named_modules():
            if not isinstance(mod, nn.Linear) or isinstance(mod, Float8Linear):
                continue
            fqn = prefix + name
            reason = self._skip_reason(mod, fqn, tuple(keep))
            if reason is None:
                eligible[id(mod)] = (fqn, mod)
            else:
                self.skipped[fqn] = reason
        if not eligible:
            logger.info("float8: no eligible Linear under '%s'", fqn_prefix or "<root>")
            return module

        if self.enable_fsdp_float8_all_gather:
            uneven = [(fqn, m.weight.shape[0]) for fqn, m in eligible.values()
                      if m.weight.shape[0] % self.dp_size]
            if uneven:
                self._turn_off_all_gather(uneven)
        config = Float8LinearConfig(
            enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather, emulate=self.emulate)
        convert_to_float8_training(
            module, module_filter_fn=lambda mod, _fqn: id(mod) in eligible, config=config)
        self._any_float8_all_gather |= self.enable_fsdp_float8_all_gather
        names = [fqn for fqn, _ in eligible.values()]
        self.converted += names
        logger.info("float8: converted %d Linears under '%s' (%s, float8 all-gather %s); "
                    "skipped %d%s", len(names), fqn_prefix or "<root>",
                    "EMULATED" if self.emulate else "real float8 GEMMs",
                    "on" if self.enable_fsdp_float8_all_gather else "off", len(self.skipped),
                    f": {self.skipped}" if self.skipped else "")
        return module

    def _turn_off_all_gather(self, uneven: list[tuple[str, int]]) -> None:
        fqn, rows = uneven[0]
        more = f" and {len(uneven) - 1} more" if len(uneven) > 1 else ""
        # FSDP2 pads uneven dim-0 shards, but torchao builds the unsharded float8 view for the
        # unpadded size, which reads past the gathered storage
        self.all_gather_off_reason = (f"DP size {self.dp_size} does not divide the {rows} rows of "
                                      f"{fqn}{more}")
        self.enable_fsdp_float8_all_gather = False
        logger.warning("float8: float8 all-gather OFF (%s): weights are all-gathered in bf16, the "
                       "GEMMs still run in float8", self.all_gather_off_reason)

    @property
    def precompute_enabled(self) -> bool:
        return self.enabled and self._any_float8_all_gather and self.precompute_scales

    def post_optimizer_hook(self, model: nn.Module | Iterable[nn.Module]) -> None:
        """After each optimizer step: one all-reduce computes every float8 weight scale for the
        next all-gather (instead of one per weight inside the FSDP pre-all-gather hook)."""
        if not self.precompute_enabled:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for m in [model] if isinstance(model, nn.Module) else model:
            precompute_float8_dynamic_scale_for_fsdp(m)

    def describe(self) -> dict[str, Any]:
        """What float8 actually does in this run (printed at start, saved with checkpoints)."""
        if not self.enabled:
            return {"enabled": False}
        return {
            "enabled": True,
            "mode": "emulated" if self.emulate else "float8",
            "emulate_reason": self.emulate_reason,
            "fsdp_float8_all_gather": self.enable_fsdp_float8_all_gather,
            "all_gather_off_reason": self.all_gather_off_reason,
            "precompute_scales": self.precompute_enabled,
            "converted": len(self.converted),
            "skipped": dict(self.skipped),
        }
