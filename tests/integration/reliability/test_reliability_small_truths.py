"""Small truths: the logged lr is the one the step used, one TensorBoard run across resumes, a
finished job run again says so and does not re-export, the export's config names its dtype, the
README points only at files a clone has."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch

from titan_draft.checkpoint.export import load_export
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer
from helpers import REPO, job_args, run_training


def test_lr_tensorboard_finished_job_and_export_dtype(tmp_path, chat_jsonl, random_target_dir, caplog):
    common = ("--training.steps", "4", "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "true",
              "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "0.01")
    args = job_args(tmp_path, chat_jsonl, random_target_dir, *common)
    with pytest.raises(KeyboardInterrupt):
        run_training(args, crash_after_step=3)  # logged step 3 after its last checkpoint (step 2)

    trainer = Trainer(ConfigManager().parse_args(args))
    used, logged = [], {}
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    log = trainer.metrics.log
    trainer.metrics.log = lambda step, scalars, total: (logged.__setitem__(step, scalars["lr"]), log(step, scalars, total))[1]
    try:
        trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    # each logged lr is the one its optimizer step used (the first call is the zero-lr step that
    # materializes the optimizer state for the checkpoint load)
    assert sorted(logged) == [3, 4] and [logged[3], logged[4]] == used[-2:] and len(used) == 3

    # one TensorBoard run for the job; the killed run's step 3 is replaced, not doubled
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert os.listdir(tmp_path / "tb") == ["run"]
    acc = EventAccumulator(str(tmp_path / "tb" / "run"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]

    tensors, config = load_export(str(tmp_path / "export"))
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.bfloat16}
    assert config["torch_dtype"] == "bfloat16"

    # the same finished job again: says there is nothing to train, leaves the export alone
    before = os.stat(tmp_path / "export" / "model.safetensors").st_mtime_ns
    with caplog.at_level(logging.INFO):
        assert run_training(args) == {}
    assert "nothing to train: resumed at step 4 and the job has 4 steps" in caplog.text
    assert "the export of step 4 is already in" in caplog.text
    assert os.stat(tmp_path / "export" / "model.safetensors").st_mtime_ns == before


def test_readme_links_only_files_in_the_repository():
    text = open(os.path.join(REPO, "README.md")).read()
    for target in re.findall(r"`(\.\./[^`]+)`", text) + re.findall(r"\]\((\.\./[^)]+)\)", text):
        pytest.fail(f"README.md points outside the repository: {target}")
