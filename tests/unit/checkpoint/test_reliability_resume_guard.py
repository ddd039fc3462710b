"""The resume guard: a data position is resumed only under the job keys it was saved with, or
explicitly reset."""

from __future__ import annotations

import json

import pytest

from titan_draft.checkpoint.resume_guard import DATA_KEYS
from titan_draft.data.chat.format import ChatFormat
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer
from helpers import job_args, run_training


def _position(trainer):
    state = trainer.dataloader._source_state()
    return state["epoch"], state["position"]


def test_changed_data_keys_are_refused_or_explicitly_reset(tmp_path, chat_jsonl, random_target_dir):
    common = ("--training.steps", "5", "--checkpoint.interval", "2")
    args = lambda dump, *extra: job_args(dump, chat_jsonl, random_target_dir, *common, *extra)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        run_training(args(tmp_path / "run"), crash_after_step=2)
    saved = json.loads((tmp_path / "run" / "checkpoint" / "step-2" / DATA_KEYS).read_text())
    assert saved["data.max_length"] == 64 and saved["training.local_batch_size"] == 2
    assert saved["data-parallel ranks"] == 1 and saved["data.chat_template"] == "qwen3"

    with pytest.raises(ValueError, match=r"step-2: this job changes what its data position means \(data.max_length "
                                         r"64 -> 128, training.local_batch_size 2 -> 3\); .*checkpoint.reset_data_position"):
        run_training(args(tmp_path / "run", "--data.max_length", "128", "--training.local_batch_size", "3"))
    with pytest.raises(ValueError, match=r"data.source \".*chat.jsonl\" -> \".*other.jsonl\""):
        other = tmp_path / "other.jsonl"
        other.write_text(open(chat_jsonl).read())
        run_training(job_args(tmp_path / "run", str(other), random_target_dir, *common))

    # reset: weights, optimizer and step resume, the data starts from row 0 under the new keys
    changed = ("--data.max_length", "128")
    trainer = Trainer(ConfigManager().parse_args(args(tmp_path / "run", *changed, "--checkpoint.reset_data_position", "true")))
    try:
        resumed = trainer.train()
        resumed_position = _position(trainer)
    finally:
        trainer.close()
        destroy_distributed()
    assert sorted(resumed) == [3, 4, 5]
    fresh = Trainer(ConfigManager().parse_args(job_args(tmp_path / "fresh", chat_jsonl, random_target_dir, *changed,
                                                        "--training.steps", "3", "--checkpoint.enable", "false",
                                                        "--checkpoint.export", "false")))
    try:
        fresh.train()
        assert resumed_position == _position(fresh)  # 3 steps read from the start, as a fresh run does
    finally:
        fresh.close()
        destroy_distributed()
    # the next resume is under the new keys, so it needs no flag
    assert json.loads((tmp_path / "run" / "checkpoint" / "step-5" / DATA_KEYS).read_text())["data.max_length"] == 128


def test_another_split_of_the_same_global_batch_is_not_a_change(tmp_path):
    from titan_draft.checkpoint.resume_guard import check_data_keys, write_data_keys

    saved = {"data.max_length": 64, "training.local_batch_size": 2, "training.grad_accum_steps": 3,
             "data-parallel ranks": 2}
    write_data_keys(str(tmp_path), saved)
    # 2 x 3 x 2 = 1 x 3 x 4 = 12 samples a step: the data position is resumed (the loader moves it)
    assert check_data_keys(str(tmp_path), {**saved, "training.local_batch_size": 1, "data-parallel ranks": 4},
                           reset=False) is False
    # ... unless the job asks to start the data afresh
    assert check_data_keys(str(tmp_path), {**saved, "data-parallel ranks": 4, "training.local_batch_size": 1},
                           reset=True) is True
    with pytest.raises(ValueError, match=r"\(data-parallel ranks 2 -> 4\); local_batch_size, grad_accum_steps and the "
                                         r"DP size may change when their product \(the global batch\) stays 12; "
                                         r"resume with the saved values"):
        check_data_keys(str(tmp_path), {**saved, "data-parallel ranks": 4}, reset=False)
    with pytest.raises(ValueError, match=r"\(data.max_length 64 -> 128\); resume with the saved values"):
        check_data_keys(str(tmp_path), {**saved, "data.max_length": 128, "data-parallel ranks": 4,
                                        "training.local_batch_size": 1}, reset=False)


def test_a_position_saved_before_repeats_of_held_out_prompts_were_left_out_is_refused(tmp_path):
    from titan_draft.checkpoint.resume_guard import build_data_keys, check_data_keys, write_data_keys

    def keys(holdout_rows):
        cfg = ConfigManager().parse_args(["--data.holdout_rows", str(holdout_rows)])
        return build_data_keys(cfg, chat=ChatFormat("chatml", "", cfg.data.enable_thinking), dp_world=1)

    older = {k: v for k, v in keys(8).items() if k != "data.holdout_split"}  # what an older version saved
    write_data_keys(str(tmp_path), older)
    with pytest.raises(ValueError, match=r"\(data.holdout_split null -> \"held-out rows and later rows asking"):
        check_data_keys(str(tmp_path), keys(8), reset=False)
    # without held-out rows the split is the same as before: nothing to refuse
    write_data_keys(str(tmp_path), keys(0))
    assert "data.holdout_split" not in keys(0) and check_data_keys(str(tmp_path), keys(0), reset=False) is False


def test_a_refused_resume_is_one_line_from_the_cli(tmp_path, chat_jsonl, random_target_dir, capsys):
    from titan_draft.cli import run_cli
    from titan_draft.checkpoint.resume_guard import ResumeRefusedError

    class Refused:
        stop_line = None

        def train(self):
            raise ResumeRefusedError("data: the data position saved by 2 DP ranks cannot be moved exactly to 4: ...")

        def close(self):
            pass

    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda cfg: Refused(), job_args(tmp_path / "run", chat_jsonl, random_target_dir))
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "titan_draft: error: data: the data position saved by 2 DP ranks cannot be moved exactly to 4: ...")
