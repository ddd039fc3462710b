"""run_info.json: what a run really did (device, layout, draft, target, data, dtype, compile,
float8, static shapes), printed at start and written next to the checkpoints."""

from __future__ import annotations

from typing import Any

from titan_draft.distributed.parallelize import mixed_precision_dtypes


def build_run_info(trainer: Any, *, target_dtype: str, n_params: int) -> dict:
    """The record of a built ``Trainer`` (its parts as the trainer holds them)."""
    cfg, on_gpu = trainer.cfg, trainer.device.type == "cuda"
    return {
        "device": str(trainer.device),
        "backend": trainer.dist.backend,
        "world_size": trainer.dp_world,
        "parallelism": {"dp_replicate": trainer.parallel_dims.dp_replicate,
                        "dp_shard": trainer.parallel_dims.dp_shard},
        "draft": f"{cfg.model.name}/{cfg.model.flavor}",
        "draft_trainable_params": n_params,
        "target": trainer.target.source,
        "target_backend": cfg.target.backend,
        "tokenizer": trainer.tokenizer.name,
        "chat_template": trainer.chat.template,
        "system_prompt": trainer.chat.system_prompt,
        "enable_thinking": trainer.chat.enable_thinking,
        "data_source": cfg.data.source,
        "features": trainer.features.describe(),
        "holdout_rows": cfg.data.holdout_rows,
        "eval_prompts": [p.name for p in trainer.evaluator.prompts] if trainer.evaluator.enabled else [],
        # tokens the draft reserves (DFlash: its mask token), as ids and text
        "reserved_tokens": [[i, trainer.tokenizer.decode([i]) if i < trainer.tokenizer.n_vocab else None]
                            for i in trainer.reserved_tokens],
        "target_dtype": target_dtype,
        "capture_layers": trainer.layer_ids,
        "param_dtype": mixed_precision_dtypes(cfg, trainer.device.type)[0],
        "static_shapes": cfg.training.static_shapes,
        "compile": cfg.compile.enable,
        "compile_target": trainer.target.compiled,
        "float8": trainer.float8.describe(),
        "activation_checkpoint": cfg.activation_checkpoint.mode,
        "attention": "flex (compiled)" if on_gpu else "sdpa with dense mask (cpu)",
        "total_steps": trainer.total_steps,
        "global_batch_size": cfg.training.local_batch_size * cfg.training.grad_accum_steps * trainer.dp_world,
    }
