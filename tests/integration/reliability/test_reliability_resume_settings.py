"""A resumed trainer trains with the values its job states or refuses (after a NaN stop, "lower the
lr and run again" runs at the lower lr), and a refusal leaves the dump folder as it was; a missing load_step or a folder of damaged checkpoints is one line, said
before the target loads."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import titan_draft.train as train_module
from helpers import job_args, poison_features
from titan_draft.checkpoint.integrity import write_integrity_record
from titan_draft.checkpoint.resume_guard import OPTIMIZER_KEYS, ResumeRefusedError
from titan_draft.components.nonfinite import NonFiniteError
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer

COMMON = ("--training.steps", "4", "--checkpoint.interval", "2", "--optimizer.lr", "0.01",
          "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_type", "constant")


def _train(argv) -> tuple[dict[int, float], list[float]]:
    """The losses of the steps trained, and the lr of every optimizer step taken."""
    trainer = Trainer(ConfigManager().parse_args(argv))
    used: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    try:
        return trainer.train(), used
    finally:
        trainer.close()
        destroy_distributed()


def test_after_a_nan_stop_a_lower_lr_is_refused_leaving_the_folder_or_applied_with_the_flag(
        tmp_path, chat_jsonl, random_target_dir, monkeypatch):
    args = lambda dump, *extra: job_args(dump, chat_jsonl, random_target_dir, *COMMON, *extra)  # noqa: E731
    run, plain = tmp_path / "run", tmp_path / "plain"
    # the run stops at a non-finite step 3; the usual answer is "lower the lr and run again"
    trainer = Trainer(ConfigManager().parse_args(args(run)))
    poison_features(monkeypatch, trainer, {3})
    try:
        with pytest.raises(NonFiniteError, match="step 3"):
            trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    shutil.copytree(run, plain)
    ckpt = run / "checkpoint"
    shutil.copytree(ckpt / "step-2", ckpt / "step-6")  # a save killed before DCP's .metadata
    os.remove(ckpt / "step-6" / ".metadata")
    files = {name: (run / name).read_bytes() for name in ("job_config.toml", "run_info.json")}

    lower = ("--optimizer.lr", "0.001", "--optimizer.weight_decay", "0.1")
    with pytest.raises(ResumeRefusedError, match=r"step-2: this job changes the optimizer or lr schedule it was saved "
                                                 r"with \(optimizer.lr 0.01 -> 0.001, optimizer.weight_decay 0.0 -> 0.1\)"
                                                 r"; .*checkpoint.apply_new_optimizer_settings = true"):
        Trainer(ConfigManager().parse_args(args(run, *lower)))
    # refused: the run's files are as they were, the incomplete folder too
    assert {name: (run / name).read_bytes() for name in files} == files
    assert (ckpt / "step-6").is_dir()

    resumed_plain, _ = _train(args(plain))
    resumed, used = _train(args(run, *lower, "--checkpoint.apply_new_optimizer_settings", "true"))
    # the steps after the resume ran at the new lr (the first hook call is the zero-lr step that
    # materializes the optimizer state for the load)
    assert used[1:] == [0.001, 0.001]
    assert sorted(resumed) == sorted(resumed_plain) == [3, 4]
    assert resumed[3] == pytest.approx(resumed_plain[3], rel=1e-6)  # the same restored weights
    assert resumed[4] != pytest.approx(resumed_plain[4], rel=1e-4)  # step 3 moved them otherwise
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-4"]  # the debris went, the checkpoints stay
    saved = json.loads((ckpt / "step-4" / OPTIMIZER_KEYS).read_text())
    assert (saved["optimizer.lr"], saved["optimizer.weight_decay"]) == (0.001, 0.1)
    assert "lr = 0.001" in (run / "job_config.toml").read_text()


def _fake_checkpoints(folder, steps, damaged=()):
    """Step folders that look complete (DCP's .metadata), each with its integrity record."""
    for step in steps:
        path = folder / "checkpoint" / f"step-{step}"
        os.makedirs(path)
        (path / ".metadata").write_bytes(b"m")
        (path / "__0_0.distcp").write_bytes(b"0123456789")
        write_integrity_record(str(path))
        if step in damaged:
            (path / "__0_0.distcp").write_bytes(b"01234")


@pytest.mark.parametrize("case", ["missing_load_step", "none_verifies"])
def test_no_checkpoint_to_resume_is_one_line_before_the_target_loads(tmp_path, chat_jsonl, random_target_dir,
                                                                      monkeypatch, capsys, case):
    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the checkpoint choice was refused")

    monkeypatch.setattr(train_module, "build_features", no_target)
    if case == "missing_load_step":
        _fake_checkpoints(tmp_path, (2, 4))
        extra, line = ("--checkpoint.load_step", "3"), (
            f"titan_draft: error: checkpoint step 3 requested (checkpoint.load_step) but {tmp_path}/checkpoint/step-3 "
            f"does not exist; the complete checkpoints in {tmp_path}/checkpoint are step-2, step-4 "
            "(checkpoint.load_step -1 resumes from the newest)")
    else:
        _fake_checkpoints(tmp_path, (2, 4), damaged=(2, 4))
        extra, line = (), (
            f"titan_draft: error: checkpoint: none of the 2 checkpoint(s) in {tmp_path}/checkpoint verifies "
            "(step-4 (__0_0.distcp is 5 bytes, its integrity.json says 10); step-2 (__0_0.distcp is 5 bytes, its "
            "integrity.json says 10)); refusing to start over on top of them: move them away to start afresh, or "
            "set checkpoint.load_step to one of them to see its error")
    try:
        with pytest.raises(SystemExit) as exit_info:
            train_module.main(job_args(tmp_path, chat_jsonl, random_target_dir, *extra))
    finally:
        destroy_distributed()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == line and "Traceback" not in err
    assert not (tmp_path / "job_config.toml").exists()
