"""Trainer: wires config, data, target, draft, optimizer, checkpoints and metrics.

Run with ``python -m titan_draft.train --job.config_file train_configs/debug_model.toml`` or through
``run_train.sh`` (torchrun).
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from titan_draft.cli import run_cli
from titan_draft.checkpoint.manager import CheckpointManager, TrainState, resolve_resume_step
from titan_draft.checkpoint.export import build_target_record, export_draft, exported_step
from titan_draft.components.disk_full import write_atomic
from titan_draft.components.float8 import Float8Converter
from titan_draft.components.lr_scheduler import build_lr_scheduler
from titan_draft.components.metrics import LogWindow, MetricsLogger, StepSums, get_peak_flops, metric_ratios
from titan_draft.components.model_args import resolve_model_args
from titan_draft.components.nonfinite import build_nonfinite_guard
from titan_draft.components.optimizer import build_optimizer
from titan_draft.components.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from titan_draft.checkpoint.resume_guard import build_data_keys, build_optimizer_keys
from titan_draft.components.run_info import build_run_info
from titan_draft.components.run_lock import maybe_acquire_run_lock
from titan_draft.components.signals import maybe_handle_stop_signals
from titan_draft.components.validation import Validator
from titan_draft.features.builder import build_features
from titan_draft.features.target import build_target_tokenizer
from titan_draft.config import write_job_config
from titan_draft.config.job_config import JobConfig
from titan_draft.data.chat.format import build_chat_format
from titan_draft.data.packing import packed_counts
from titan_draft.data.pipeline import build_dataloader, epoch_samples
from titan_draft.distributed.parallelize import to_dtype
from titan_draft.distributed.utils import (
    ParallelDims,
    init_distributed,
    set_pg_timeout,
    set_seed,
)
from titan_draft.checkpoint.model_args import save_model_args
from titan_draft.decoding.evaluator import Evaluator, report_scalars
from titan_draft.logger import logger
from titan_draft.protocols import PrepareContext, get_model_spec


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.run_lock = None
        try:
            self._build(cfg)
        except BaseException:
            self._release_lock()  # a trainer that failed to start holds nothing
            raise

    def _build(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.dist = init_distributed(cfg)
        self.device = self.dist.device
        self.parallel_dims = ParallelDims.from_config(cfg, world_size=self.dist.world_size)
        self.parallel_dims.build_mesh(self.device.type)
        self.dp_mesh = self.parallel_dims.dp_mesh
        self.dp_rank, self.dp_world = self.dist.rank, self.dist.world_size
        on_gpu = self.device.type == "cuda"
        set_seed(cfg.training.seed)
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        self.run_lock = maybe_acquire_run_lock(cfg.job.dump_folder, self.dist.rank == 0)  # before any write
        resume_step = resolve_resume_step(cfg.checkpoint, cfg.job.dump_folder)  # its refusals: before the target

        self.spec = get_model_spec(cfg.model.name)

        # Target: built on the meta device, sharded, then each rank loads only its shard (offline:
        # its tables alone). Where the features come from is decided there, once.
        target_dtype = cfg.target.dtype if on_gpu else "float32"  # CPU runs everything in fp32
        self.features = build_features(cfg, self.device, to_dtype(target_dtype), mesh=self.parallel_dims.shard_mesh)
        self.target = self.features.target
        self.tokenizer = build_target_tokenizer(cfg, self.target.args.vocab_size)
        self.chat = build_chat_format(cfg.data, self.tokenizer)  # resolved once, handed to everything that renders
        self.model_args = resolve_model_args(self.spec, cfg, self.target.args, self.tokenizer, self.chat)
        self.layer_ids = list(self.spec.capture_layers_fn(self.model_args))
        self.needs_last_hidden = self.spec.needs_last_hidden_for(self.model_args)
        reserved = self.spec.reserved_tokens_fn
        self.reserved_tokens = list(reserved(self.model_args)) if reserved is not None else []
        # offline: a cache of other features is refused here, before the data pass and the model
        self.features_fn = self.features.bind(
            tokenizer=self.tokenizer, chat=self.chat, layer_ids=self.layer_ids,
            need_last_hidden=self.needs_last_hidden, reserved_ids=self.reserved_tokens,
            dp_rank=self.dp_rank, dp_world=self.dp_world)
        if self.spec.prepare_fn is not None:  # a pass over the data before the model exists
            self.model_args = self.spec.prepare_fn(self.model_args, self._prepare_context())

        pad_multiple = 16 if cfg.float8.enable else 1
        self.dataloader = build_dataloader(
            cfg.data,
            self.tokenizer,
            chat=self.chat,
            dp_rank=self.dp_rank,
            dp_world=self.dp_world,
            local_batch_size=cfg.training.local_batch_size,
            seed=cfg.training.seed,
            static_shapes=cfg.training.static_shapes,
            pad_multiple=pad_multiple,
            reserved_ids=frozenset(self.reserved_tokens),
            warn_below_rows=10 * cfg.training.local_batch_size * cfg.training.grad_accum_steps,
            layer_ids=self.layer_ids,
            need_last_hidden=self.needs_last_hidden,
            pin_memory=on_gpu,
        )
        self.total_steps = self._total_steps()

        torch.manual_seed(cfg.training.seed)
        with torch.device(self.device):
            model = self.spec.model_cls(self.model_args)
        with torch.no_grad():
            model.init_weights()
        tmodel = self.target.model
        model.load_frozen_tables(tmodel.embed_weight(), tmodel.lm_head_weight())

        # torchtitan's order: float8 first, then the draft's parallelize_fn (AC, compile, FSDP)
        self.float8 = Float8Converter(cfg, self.parallel_dims)
        self.float8.convert(model, keep=self.spec.float8_skip)
        self.model = self.spec.parallelize_fn(model, self.parallel_dims, cfg, dp_mesh=self.dp_mesh)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        n_params = sum(p.numel() for p in self.params)

        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device.type)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, self.total_steps)
        self.train_state = TrainState()
        self.checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader,
            train_state=self.train_state,
            dp_rank=self.dp_rank,
            dp_world=self.dp_world,
            data_keys=build_data_keys(cfg, chat=self.chat, dp_world=self.dp_world),
            optimizer_keys=build_optimizer_keys(cfg, self.device.type, self.total_steps),
            resume_step=resume_step,
        )
        self.checkpointer.prepare_resume()  # a refused resume: before anything in the dump folder is written
        self.checkpointer.remove_incomplete()
        self.nonfinite = build_nonfinite_guard(cfg.training, self.model, self.checkpointer.describe_last)
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, self.dist.rank, self.device.type)
        self.evaluator = Evaluator(cfg, self.spec, self.model_args, self.target.model, self.tokenizer, self.chat,
                                   self.device, reserved_ids=self.reserved_tokens)
        self.validator = Validator(cfg, self.tokenizer, self.chat, self.device, dp_rank=self.dp_rank, dp_world=self.dp_world,
                                   reserved_ids=frozenset(self.reserved_tokens), pad_multiple=pad_multiple)
        self.peak_flops = get_peak_flops(torch.cuda.get_device_name(self.device)) if on_gpu else None

        self.run_info = build_run_info(self, target_dtype=target_dtype, n_params=n_params)
        logger.info("run: " + json.dumps(self.run_info))
        if self.dist.rank == 0:
            write_job_config(cfg, os.path.join(cfg.job.dump_folder, "job_config.toml"))
            write_atomic(os.path.join(cfg.job.dump_folder, "run_info.json"), json.dumps(self.run_info, indent=2))
            save_model_args(self.model_args, cfg.job.dump_folder)

    def _prepare_context(self) -> PrepareContext:
        cfg, device, world = self.cfg, self.device, self.dp_world

        def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
            if world == 1:
                return t
            out = t.to(device)
            torch.distributed.all_reduce(out)
            return out.cpu()

        return PrepareContext(
            job=cfg, tokenizer=self.tokenizer, chat=self.chat, dump_folder=cfg.job.dump_folder,
            dp_rank=self.dp_rank, dp_world=world,
            samples=lambda: epoch_samples(cfg.data, self.tokenizer, chat=self.chat, dp_rank=self.dp_rank,
                                          dp_world=world, seed=cfg.training.seed,
                                          reserved_ids=frozenset(self.reserved_tokens)),
            all_reduce_sum=all_reduce_sum,
            barrier=(lambda: torch.distributed.barrier()) if world > 1 else (lambda: None),
        )

    def _total_steps(self) -> int:
        t = self.cfg.training
        if t.epochs <= 0:
            return t.steps
        per_step = t.local_batch_size * t.grad_accum_steps
        steps_per_epoch = max(1, self.dataloader.rows_per_rank // per_step)
        return t.epochs * steps_per_epoch

    # ---- one optimizer step ----

    def _generator(self, step: int, micro: int) -> torch.Generator:
        """Anchor sampling RNG derived from (seed, step, micro-batch, rank): a resumed run samples the
        same anchors as an uninterrupted one without saving RNG state."""
        g = torch.Generator(device=self.device)
        seed = (self.cfg.training.seed * 1_000_003 + step) * 1_000_003 + micro * 7919 + self.dp_rank * 104_729
        g.manual_seed(seed % (2**63))
        return g

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict:
        step = self.train_state.step
        self.model.set_train_progress(step, self.total_steps)
        self.optimizer.zero_grad(set_to_none=True)
        sums = StepSums(self.device)
        pin = self.device.type == "cuda"  # from pageable memory the copy waits for the stream
        for micro, batch in enumerate(micro_batches):
            batch = {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) for k, v in batch.items()}
            # named regions: a profile's trace then says what each phase costs the host and the GPU
            with record_function("titan_draft.features"):
                features = self.features_fn(batch)
            with record_function("titan_draft.draft_forward"):
                out = self.model(features, generator=self._generator(step, micro))
            with record_function("titan_draft.backward"):
                out.loss_sum.backward()
            sums.add(out)
        # One all-reduce for the denominator, the loss and every metric.
        flat, names = sums.flat()
        if self.dp_world > 1:
            torch.distributed.all_reduce(flat)
        global_denom = flat[1]
        # FSDP averaged the gradients over DP ranks; turn that into sum / global denominator.
        scale = (self.dp_world / global_denom.clamp(min=1e-12)).float()
        reached = False
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
                reached = True
        if not reached:
            raise RuntimeError(f"step {step}: no trainable parameter of the draft received a gradient "
                               "(its loss does not reach them, or FSDP did not reduce them)")
        max_norm = self.cfg.training.max_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"), foreach=True)
        if isinstance(grad_norm, DTensor):  # FSDP2: the norm of the sharded gradients
            grad_norm = grad_norm.full_tensor()
        applied = self.nonfinite.allow_update(step, flat[0], grad_norm)  # raises to stop
        if applied:
            with record_function("titan_draft.optimizer"):
                self.optimizer.step()
            self.float8.post_optimizer_hook(self.model)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step used, read before it moves on
        self.lr_scheduler.step()
        return {"flat": flat, "names": names, "grad_norm": grad_norm, "applied": applied, "lr": lr}

    # ---- loop ----

    def train(self) -> dict[int, float]:
        """Run to the last step; returns the global loss of every logged step."""
        cfg = self.cfg
        self.stop_line = ""  # set when a stop signal ends the run early
        start = self.checkpointer.load()
        if start:
            logger.info(f"resumed from step {start} ({self.checkpointer.folder})")
            self.metrics.resume_at(start)
        if start >= self.total_steps > 0:
            return self._already_done(start)
        data_iter = iter(self.dataloader)
        losses: dict[int, float] = {}
        accum = cfg.training.grad_accum_steps
        window = LogWindow()
        with maybe_handle_stop_signals(self.device) as stop, maybe_enable_profiling(cfg.profiling, cfg.job.dump_folder, self.train_state.step, self.dist.rank) as prof, \
                maybe_enable_memory_snapshot(cfg.profiling, cfg.job.dump_folder, self.train_state.step, self.dist.rank) as snap:
            while self.train_state.step < self.total_steps:
                t0 = time.perf_counter()
                micro_batches = [next(data_iter) for _ in range(accum)]
                window.data_wait += time.perf_counter() - t0
                self.train_state.step += 1
                step = self.train_state.step
                counts = [packed_counts(b) for b in micro_batches]
                tokens = sum(t for _, t in counts)
                self.train_state.tokens_seen += tokens
                window.tokens += tokens
                window.positions += sum(b["input_ids"].numel() for b in micro_batches)
                window.samples += sum(n for n, _ in counts)
                window.steps += 1
                out = self.train_step(micro_batches)
                if self.metrics.should_log(step, self.total_steps):
                    flat = out["flat"].tolist()
                    loss = flat[0] / max(flat[1], 1e-12)
                    losses[step] = loss
                    elapsed = time.perf_counter() - window.start
                    scalars = {
                        "loss": loss,
                        "lr": out["lr"],
                        "grad_norm": float(out["grad_norm"]),
                        "tokens_per_s": window.tokens / elapsed,  # real tokens, padding left out
                        "padding_fraction": 1.0 - window.tokens / max(window.positions, 1),
                        "samples_per_s": window.samples * self.dp_world / elapsed,
                        "step_time_s": elapsed / window.steps,
                        "data_wait_s": window.data_wait / window.steps,
                    }
                    scalars.update(metric_ratios(flat, out["names"]))
                    if self.peak_flops and self.spec.flops_fn is not None:
                        b0 = micro_batches[0]["input_ids"]
                        flops = self.spec.flops_fn(self.model_args, b0.shape[0], b0.shape[1]) * accum
                        scalars["mfu"] = 100.0 * flops / (elapsed / window.steps) / self.peak_flops
                    skipped = self.dataloader.epoch_skip_counts  # this epoch's: a bad row counts once
                    scalars["data/skipped_rows"] = sum(skipped.values())
                    self.metrics.log(step, scalars, self.total_steps)
                    if step in (start + 1, self.total_steps):
                        logger.info(f"data rows skipped in epoch {self.dataloader.epoch} on DP rank "
                                    f"{self.dp_rank} so far: {skipped}")
                    window = LogWindow()
                if self.checkpointer.should_save(step, force=step == self.total_steps):
                    self.nonfinite.check_params(step)  # a non-finite checkpoint is never written
                self.checkpointer.save(step, force=step == self.total_steps)
                if stop.requested():  # SIGTERM/SIGINT: this step is done; save it and leave
                    self._stop_after(step, stop.name)
                    break
                self._maybe_eval(step, out)
                if prof is not None:
                    prof.step()
                if snap is not None:
                    snap.step()
                if step == start + 1 and self.dist.world_size > 1:
                    # start-up (compile, first collectives) is over: use the shorter timeout
                    set_pg_timeout(cfg.comm.train_timeout_seconds)
        if cfg.checkpoint.export and not self.stop_line:
            with maybe_handle_stop_signals(self.device):  # a stop this late lets the export finish
                self._export()
        return losses

    def _export(self) -> None:
        cfg = self.cfg
        out_dir = os.path.join(cfg.job.dump_folder, cfg.checkpoint.export_folder)
        export_draft(
            self.model, self.spec.export_fn, self.model_args,
            {**self.target.info, "capture_layers": self.layer_ids},
            out_dir,
            dtype=cfg.checkpoint.export_dtype,
            extra_config={"step": self.train_state.step, "run": self.run_info},
            is_rank0=self.dist.rank == 0,
            target_record=build_target_record(self.target.model, self.target.args, self.target.family),
        )
        logger.info(f"exported draft to {out_dir}")

    def _already_done(self, start: int) -> dict[int, float]:
        """A job resumed at or past its last step trains nothing; say so, and export only when no
        export of this step is there yet."""
        cfg = self.cfg
        logger.warning(f"nothing to train: resumed at step {start} and the job has {self.total_steps} steps "
                       "(raise training.steps with checkpoint.apply_new_optimizer_settings = true to train on)")
        out_dir = os.path.join(cfg.job.dump_folder, cfg.checkpoint.export_folder)
        if exported_step(out_dir) == start:
            logger.info(f"the export of step {start} is already in {out_dir}")
        elif cfg.checkpoint.export:
            self._export()
        return {}

    def _stop_after(self, step: int, signal_name: str) -> None:
        """Save ``step`` (if not saved yet) and set the line that tells where to resume."""
        if self.checkpointer.should_save(step, force=True):
            self.nonfinite.check_params(step)
        saved = self.checkpointer.save(step, force=True) or self.checkpointer.is_saved(step)
        where = (f"checkpoint {self.checkpointer.step_folder(step)} saved; run the same command again "
                 f"to resume from step {step}" if saved else "checkpointing is off: nothing was saved")
        self.stop_line = f"stopped by {signal_name} after step {step} of {self.total_steps}: {where} (no export written)"
        logger.warning(self.stop_line)

    def _maybe_eval(self, step: int, out: dict) -> None:
        """The held-out figures at validation steps; the true τ (real speculative decoding) at
        eval steps, beside the simulated one."""
        if self.validator.should_run(step, self.total_steps):
            self.metrics.add_scalars(step, self.validator.run(self.model, self.features_fn, step))
        if not self.evaluator.should_run(step, self.total_steps):
            return
        report = self.evaluator.run(self.model, step, self.dist.rank == 0)
        scalars = report_scalars(report)
        if "accept_len" in out["names"]:
            scalars["eval/simulated_accept_len"] = metric_ratios(out["flat"].tolist(), out["names"])["accept_len"]
        self.metrics.add_scalars(step, scalars)

    def _release_lock(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def close(self):
        try:
            self.dataloader.close()  # its threads stop before the interpreter exits (data/loader_state.py)
        finally:
            try:
                self.metrics.close()
            finally:
                self._release_lock()


def main(argv: list[str] | None = None) -> None:
    run_cli(Trainer, argv)  # titan_draft/cli.py: one line and an exit status for every user error


if __name__ == "__main__":
    main()
