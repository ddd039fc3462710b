"""What the tests share: running the real trainer (a draft's debug job, killed and resumed), the
reliability tests' tiny job and fault injection, offline mode's in-process cache, spawning gloo
ranks, and an independent FLOP count. Fixtures live in ``conftest.py``.

Spawned ranks: CI once lost a whole 2-rank module to ``terminate called without an active
exception`` (SIGABRT in rank 0, a C++ abort with no Python traceback) that 130+ local repetitions of
the same workers did not reproduce. So every rank runs with ``faulthandler`` writing all threads'
Python stacks to a file, and a rank killed by a signal is retried once with a fresh port: the test
passes only if a whole retry passes, and the pytest warning it leaves carries the stacks of the
abort. A Python exception in a rank or a non-zero exit is never retried.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException

from scripts.prepare_features import prepare
from titan_draft.components.model_args import resolve_model_args
from titan_draft.config import ConfigManager
from titan_draft.data.chat.format import build_chat_format
from titan_draft.data.pipeline import build_dataloader
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.features.offline import features_from_batch, load_feature_cache
from titan_draft.features.target import build_target, build_target_tokenizer, compute_features
from titan_draft.protocols import get_model_spec
import titan_draft.train as train_module
from titan_draft.train import Trainer

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


# ---- running the real Trainer: a draft's debug job, run to the end or killed after a checkpoint ----

# Draft -> its debug job. A draft registered without an entry here uses train_configs/<name>_debug.toml.
DEBUG_CONFIGS = {"dflash2": "debug_random.toml", "eagle3": "eagle3_debug.toml"}


def debug_config(draft: str) -> str:
    path = os.path.join(REPO, "train_configs", DEBUG_CONFIGS.get(draft, f"{draft}_debug.toml"))
    assert os.path.isfile(path), f"no debug job for draft {draft!r}: add it to tests/trainer_runs.DEBUG_CONFIGS"
    return path


def debug_job_argv(draft: str, dump, target: str, data: str, *extra: str, max_length: int = 96) -> list[str]:
    """``draft``'s debug job against ``target`` on ``data``, written to ``dump``: rows cut to
    ``max_length``, every step logged, no TensorBoard, no profiler; ``extra`` overrides any of it."""
    return ["--job.config_file", debug_config(draft), "--job.dump_folder", str(dump), "--target.path", target,
            "--data.source", data, "--data.max_length", str(max_length), "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--profiling.enable_profiling", "false", *extra]


def torchrun(nprocs: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run ... args`` on ``nprocs`` local ranks from the repo root,
    output captured: one thread per rank (the CPU has few cores), the repo importable, and
    faulthandler on, so a rank's native abort prints its Python stacks into the output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join([REPO, TESTS, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_training(argv: list[str], crash_after_step: int | None = None,
                 keep_process_group: bool = False) -> dict[int, float]:
    """Train the job of ``argv``; the global loss of every logged step. With
    ``crash_after_step`` the run dies (KeyboardInterrupt) right after saving that step.
    ``keep_process_group``: leave torch.distributed up for the next run (several jobs in one
    torchrun launch)."""
    trainer = Trainer(ConfigManager().parse_args(argv))
    if crash_after_step is not None:
        save = trainer.checkpointer.save

        def save_then_die(step, **kw):
            save(step, **kw)
            if step == crash_after_step:
                raise KeyboardInterrupt("simulated kill")

        trainer.checkpointer.save = save_then_die
    try:
        return trainer.train()
    finally:
        trainer.close()
        if not keep_process_group:
            destroy_distributed()


def check_exact_resume(argv_of: Callable[[Path], list[str]], root: Path, kill_after: int = 3,
                       before_resume: Callable[[Path], None] | None = None) -> dict[int, float]:
    """Train ``argv_of(root / "full")`` to the end; train ``argv_of(root / "killed")``, killed right
    after saving step ``kill_after``, then again (``before_resume(root / "killed")`` in between):
    the resumed run must log exactly the remaining steps, each with the uninterrupted run's loss.
    Returns the uninterrupted run's losses."""
    full = run_training(argv_of(root / "full"))
    with pytest.raises(KeyboardInterrupt):
        run_training(argv_of(root / "killed"), crash_after_step=kill_after)
    if before_resume is not None:
        before_resume(root / "killed")
    resumed = run_training(argv_of(root / "killed"))
    assert sorted(resumed) == list(range(kill_after + 1, max(full) + 1)), sorted(resumed)
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step
    return full


# ---- the reliability tests: a tiny job against the random target, and fault injection ----

def job_args(dump, data: str, target: str, *extra: str) -> list[str]:
    """The debug_random job shrunk to seconds: short rows, no TensorBoard, no profiler."""
    return debug_job_argv("dflash2", dump, target, data, "--data.max_rows", "0", "--training.local_batch_size", "2",
                          *extra, max_length=64)


def poison_features(monkeypatch, trainer, steps) -> None:
    """Make the target's captured hidden states NaN at the given optimizer steps (a diverging
    target or bad data row): the draft's loss and gradients become NaN there."""
    real = trainer.features_fn

    def poisoned(*args, **kwargs):
        features = real(*args, **kwargs)
        if trainer.train_state.step in steps:
            features.aux_hidden = torch.full_like(features.aux_hidden, float("nan"))
        return features

    monkeypatch.setattr(trainer, "features_fn", poisoned)


def weights(trainer) -> dict[str, torch.Tensor]:
    """A plain copy of the draft's trainable weights (one rank: the local shard is the whole)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters() if p.requires_grad}


# ---- offline mode: a feature cache prepared in-process, the same rows online and through the cache ----

def registered_drafts() -> list[str]:
    """Every draft a package under models/ registers (not the throwaway ones tests define)."""
    from titan_draft.protocols import model_spec
    from titan_draft.protocols.discovery import import_model_packages

    import_model_packages()
    return sorted(n for n, s in model_spec._REGISTRY.items() if s.model_cls.__module__.startswith("models."))


def job_argv(draft: str, dump, target: str, data: str, *extra: str) -> list[str]:
    """A small, fast, unshuffled job of ``draft``'s debug config (no checkpoints, no export)."""
    return debug_job_argv(draft, dump, target, data, "--data.max_rows", "20", "--data.shuffle", "false",
                          "--training.local_batch_size", "2", "--checkpoint.enable", "false",
                          "--checkpoint.export", "false", "--eval.enable", "false", *extra, max_length=48)


def prepare_cache(out, argv: list[str], *options: str) -> dict:
    """scripts/prepare_features.py in this process (one rank); its manifest."""
    try:
        return prepare(["--out", str(out), *options, *argv])
    finally:
        destroy_distributed()


class Paths:
    """One job's online batches/features and offline batches/features, side by side."""

    def __init__(self, argv: list[str]):
        cfg = self.cfg = ConfigManager().parse_args(argv)
        self.spec = get_model_spec(cfg.model.name)
        self.target = build_target(cfg, torch.device("cpu"), torch.float32)
        self.tokenizer = build_target_tokenizer(cfg, self.target.args.vocab_size)
        self.chat = build_chat_format(cfg.data, self.tokenizer)
        args = resolve_model_args(self.spec, cfg, self.target.args, self.tokenizer, self.chat)
        self.layer_ids = list(self.spec.capture_layers_fn(args))
        fn = self.spec.reserved_tokens_fn
        self.reserved = list(fn(args)) if fn is not None else []

    def online(self):
        t = self.cfg.training
        loader = build_dataloader(self.cfg.data, self.tokenizer, dp_rank=0, dp_world=1,
                                  local_batch_size=t.local_batch_size, seed=t.seed, static_shapes=t.static_shapes,
                                  reserved_ids=frozenset(self.reserved))
        for batch in loader:
            yield batch, compute_features(self.target.model, batch, self.layer_ids, self.spec.needs_last_hidden)

    def offline(self, cache: str, *, dp_rank: int = 0, dp_world: int = 1, shuffle: bool | None = None):
        data = replace(self.cfg.data, feature_cache=cache)
        if shuffle is not None:
            data.shuffle = shuffle
        cfg = replace(self.cfg, data=data)
        load_feature_cache(cfg, self.target, self.tokenizer, self.chat, layer_ids=self.layer_ids,
                           need_last_hidden=self.spec.needs_last_hidden, reserved_ids=self.reserved,
                           dp_rank=dp_rank, dp_world=dp_world)
        t = cfg.training
        return build_dataloader(cfg.data, self.tokenizer, chat=self.chat, dp_rank=dp_rank, dp_world=dp_world,
                                local_batch_size=t.local_batch_size, seed=t.seed, static_shapes=t.static_shapes,
                                layer_ids=self.layer_ids, need_last_hidden=self.spec.needs_last_hidden)

    @staticmethod
    def features(batch):
        return features_from_batch(batch, torch.float32)


# ---- spawning gloo ranks: a free port per attempt, and native aborts made visible ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, port: int, stacks_dir: str, args: tuple) -> None:
    # left open on purpose: an abort during interpreter shutdown must still be written
    faulthandler.enable(file=open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w"), all_threads=True)
    fn(rank, port, *args)


def _stacks(stacks_dir: str, rank: int) -> str:
    path = os.path.join(stacks_dir, f"rank{rank}.txt")
    if not os.path.exists(path):
        return "(no stacks file)"
    with open(path) as f:
        return f.read().strip() or "(faulthandler wrote nothing)"


def spawn_ranks(fn: Callable, *args, nprocs: int = 2, attempts: int = 2) -> None:
    """Run ``fn(rank, port, *args)`` in ``nprocs`` spawned processes (``port``: free, for the
    rank-0 store). Retries only a run in which a rank died from a signal; ``fn`` must therefore
    write its outputs fresh on every run."""
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="rank-stacks-") as stacks_dir:
            try:
                mp.spawn(_entry, args=(fn, free_port(), stacks_dir, args), nprocs=nprocs, join=True)
                return
            except ProcessExitedException as e:
                died = e.signal_name or f"exit code {e.exit_code}"
                what = (f"rank {e.error_index} of {fn.__name__} died with {died} (attempt {attempt} of "
                        f"{attempts}); its threads at the abort:\n{_stacks(stacks_dir, e.error_index)}")
                if e.signal_name is None or attempt == attempts:
                    raise RuntimeError(what) from e
                warnings.warn(what + "\nretrying with a fresh port", stacklevel=2)


def write_rank_result(out_dir: str, rank: int, compute: Callable[[], dict]) -> None:
    """Run ``compute()`` in a rank and write its JSON result, or the traceback of the Python
    error it raised, to ``rank{rank}.json`` (the test reads every rank's file)."""
    try:
        result = compute()
    except Exception:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ---- an independent FLOP count of a block-diffusion draft's step (from the modules it builds) ----

def linear_flops(model: nn.Module, seq: int, rows: int) -> int:
    """6 * rows * in * out over every Linear of ``model``: ``fc`` sees the ``seq`` context
    positions, k/v projections the context and the ``rows`` block rows, the rest the block rows."""

    def rows_of(name: str) -> int:
        if name == "fc":
            return seq
        if name.endswith(("k_proj", "v_proj")):
            return seq + rows
        return rows

    return sum(6 * rows_of(name) * m.in_features * m.out_features
               for name, m in model.named_modules() if isinstance(m, nn.Linear))


def attention_flops(args, seq: int, rows: int) -> float:
    """Forward and backward (3 x) of QK^T and PV (4 x) per head: a block row attends to the
    context before its anchor (``seq / 2`` on average) and to its own block."""
    return 12 * rows * (seq / 2 + args.block_size) * args.num_attention_heads * args.head_dim * args.num_layers


def main_error(capsys, argv) -> str:
    """The one-line error main() exits with (status 2, no traceback), without its prefix."""
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("titan_draft: error: "), err
    assert not any("Traceback" in line for line in err), err
    return err[-1][len("titan_draft: error: "):]


# tiny random checkpoints of families that only target.backend = "transformers" runs: Gemma2 (logit
# and attention soft-capping, sliding window on alternate layers), Mistral (sliding window)
def record_whole_tensor_reads() -> list[str]:
    """Make the target loaders' ``safe_open`` record every whole-tensor read (``get_tensor``) in
    the list returned; a sharded load reads slices only (``get_slice``), so the list stays empty."""
    import models.targets.qwen3.state_dict as sd_mod

    full_reads: list[str] = []
    real_open = sd_mod.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return self.inner.get_slice(key)

        def get_tensor(self, key):
            full_reads.append(key)
            return self.inner.get_tensor(key)

    sd_mod.safe_open = Recording
    return full_reads


class GreedyDrafter:
    """Base of the tests' scripted proposers: they draft deterministically (point masses), so they
    ignore the sampling setting and hand no draft distributions to the verify rule."""

    draft_probs = None

    def set_sampling(self, temperature: float, generator=None) -> None:
        pass


def inverse_cdf(q: torch.Tensor, u: float) -> int:
    """The first token whose cumulative probability exceeds u (a plain loop: the
    reference of the proposers' inverse-CDF draws)."""
    acc = 0.0
    for t, p in enumerate(q.tolist()):
        acc += p
        if acc > u * float(q.sum()):
            return t
    return q.numel() - 1
