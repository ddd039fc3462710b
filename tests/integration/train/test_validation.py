"""[validation]: the draft's figures on held-out rows, measured without touching training."""

from __future__ import annotations

import math

import pytest

from helpers import job_args
from titan_draft.config import ConfigManager
from titan_draft.config.validate import ConfigError
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer

HOLDOUT = 8


def _run(tmp_path, name, chat_jsonl, target, *extra):
    """Train 4 steps; ``(losses, {step: scalars logged}, val scalars of one more validation
    after the end or None, trainer)`` (the trainer closed)."""
    trainer = Trainer(ConfigManager().parse_args(job_args(
        tmp_path / name, chat_jsonl, target, "--training.steps", "4", "--data.holdout_rows", str(HOLDOUT),
        "--checkpoint.enable", "false", *extra)))
    seen: dict[int, dict] = {}
    add = trainer.metrics.add_scalars
    trainer.metrics.add_scalars = lambda step, s: (seen.setdefault(step, {}).update(s), add(step, s))[-1]
    try:
        losses = trainer.train()
        again = trainer.validator.run(trainer.model, trainer.features_fn, 4) if trainer.validator.enabled else None
    finally:
        trainer.close()
        destroy_distributed()
    return losses, seen, again, trainer


def test_held_out_figures_at_freq_and_end_without_changing_training(tmp_path, chat_jsonl, random_target_dir):
    plain, _, _, _ = _run(tmp_path, "plain", chat_jsonl, random_target_dir)
    losses, seen, again, _ = _run(tmp_path, "val", chat_jsonl, random_target_dir, "--validation.enable", "true",
                                  "--validation.freq", "2", "--validation.steps", "2")
    assert losses == plain  # same data position, anchors and weights: validation is a pure read
    assert sorted(seen) == [2, 4]
    for step in (2, 4):
        s = seen[step]
        assert {"val/loss", "val/acc", "val/accept_len"} <= set(s), s
        assert all(math.isfinite(v) for v in s.values())
        assert s["val/accept_len"] >= 1.0
    assert seen[2]["val/loss"] != seen[4]["val/loss"]  # the draft moved between them
    assert again == {k: v for k, v in seen[4].items() if k.startswith("val/")}  # same batches, same draws


def test_held_out_batches_are_the_rows_training_never_reads(tmp_path, chat_jsonl, random_target_dir):
    cfg = ConfigManager().parse_args(job_args(tmp_path / "r", chat_jsonl, random_target_dir, "--data.holdout_rows",
                                              str(HOLDOUT), "--validation.enable", "true", "--data.shuffle", "false"))
    trainer = Trainer(cfg)
    try:
        def rows(loader, n):
            it, out = iter(loader), []
            for _ in range(n):
                b = next(it)
                out += [tuple(ids[:length].tolist()) for ids, length in zip(b["input_ids"], b["valid_lengths"])]
            return out

        held = rows(trainer.validator._build(), HOLDOUT)  # batches of 2: every usable held-out row
        trained = rows(trainer.dataloader, 40)
    finally:
        trainer.close()
        destroy_distributed()
    assert 1 < len(set(held)) <= HOLDOUT  # some of the first rows are unusable (skipped and counted)
    assert not set(held) & set(trained)


@pytest.mark.parametrize("extra, message", [
    (("--data.holdout_rows", "0"), "validation.enable needs held-out rows to validate on: set data.holdout_rows > 0"),
    (("--data.holdout_rows", "4", "--data.feature_cache", "/nowhere"), "not available with data.feature_cache"),
    (("--data.holdout_rows", "4", "--validation.steps", "0"), "validation.steps = 0 must be >= 1"),
])
def test_bad_validation_config_is_one_line(tmp_path, chat_jsonl, random_target_dir, extra, message):
    from titan_draft.config.validate import validate_job_config

    cfg = ConfigManager().parse_args(job_args(tmp_path / "c", chat_jsonl, random_target_dir,
                                              "--validation.enable", "true", *extra))
    with pytest.raises(ConfigError, match=message):
        validate_job_config(cfg)
