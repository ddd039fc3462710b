"""The eval checks its --target against the target the export records (architecture facts and a
fingerprint of the frozen tables) and refuses another one in one line naming what differs, unless
--allow-target-mismatch; the export keeps the record beside its provenance, not in config.json."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os

import pytest
from helpers import job_args, run_training

from titan_draft.checkpoint.export import PROVENANCE_NAME, table_fingerprint
from titan_draft.config.job_config import TARGET_BACKENDS, JobConfig
from titan_draft.config.validate import validate_job_config
from titan_draft.decoding.eval_target import add_target_backend_arg, resolve_target_backend
from titan_draft.eval import main as eval_main
from titan_draft.features.target import load_target, write_random_target
from titan_draft.protocols.target_spec import get_target_spec

EVAL = ("--prompts", "mtbench", "--num-prompts", "1", "--max-new-tokens", "4", "--no-lossless-check")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, chat_jsonl, random_target_dir):
    dump = tmp_path_factory.mktemp("eval_target")
    run_training(job_args(dump, chat_jsonl, random_target_dir, "--training.steps", "1"))
    return str(dump / "export")


def _refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        eval_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("titan_draft.eval: error: "), err
    return err[-1][len("titan_draft.eval: error: "):]


def test_the_export_records_its_target(export_dir, random_target_dir):
    with open(f"{export_dir}/{PROVENANCE_NAME}") as f:
        record = json.load(f)["target"]
    target = load_target(random_target_dir)
    a = target.args
    assert record == {"family": "qwen3", "num_hidden_layers": a.num_hidden_layers, "hidden_size": a.hidden_size,
                      "vocab_size": a.vocab_size, "rope_theta": a.rope_theta,
                      "table_fingerprint": table_fingerprint(target.embed_weight(), target.lm_head_weight())}
    with open(f"{export_dir}/config.json") as f:
        assert "table_fingerprint" not in f.read()  # the serving config stays as it was


def test_a_target_with_other_weights_is_refused(capsys, caplog, export_dir, random_target_dir, tmp_path):
    other = write_random_target(str(tmp_path / "other_seed"), seed=7)  # same architecture, other tables
    line = _refused(capsys, ["--target", other, "--draft", export_dir, *EVAL])
    assert line == (f"--target: {other} is not the target {export_dir} was trained for: frozen tables (embedding / "
                    f"lm_head rows): export {_fingerprint(random_target_dir)}, target {_fingerprint(other)} "
                    "(pass --allow-target-mismatch to evaluate anyway)")
    with caplog.at_level(logging.WARNING):
        eval_main(["--target", other, "--draft", export_dir, *EVAL, "--allow-target-mismatch"])
    assert any("evaluating anyway (--allow-target-mismatch)" in r.getMessage() for r in caplog.records)


def test_a_target_with_another_layer_count_is_refused_before_it_loads(capsys, monkeypatch, export_dir, tmp_path):
    flavors = get_target_spec("qwen3").flavors
    monkeypatch.setitem(flavors, "debug4", dataclasses.replace(flavors["debugmodel"], num_hidden_layers=4))
    other = write_random_target(str(tmp_path / "four_layers"), flavor="debug4")

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before its architecture was checked")

    monkeypatch.setattr("titan_draft.decoding.eval_target.load_target", no_load)
    line = _refused(capsys, ["--target", other, "--draft", export_dir, *EVAL])
    assert line == (f"--target: {other} is not the target {export_dir} was trained for: num_hidden_layers: "
                    "export 6, target 4 (pass --allow-target-mismatch to evaluate anyway)")


def _fingerprint(folder):
    target = load_target(folder)
    return table_fingerprint(target.embed_weight(), target.lm_head_weight())


def test_a_full_disk_for_the_report_is_one_line(capsys, monkeypatch, export_dir, random_target_dir, tmp_path):
    out = tmp_path / "tau.json"

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["--target", random_target_dir, "--draft", export_dir, *EVAL, "--out", str(out)])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "true acceptance length" in captured.out  # the table was printed
    line = captured.err.strip().splitlines()[-1]
    assert line.startswith(f"titan_draft.eval: error: writing {out} failed: disk full on "), line
    assert not list(tmp_path.iterdir())  # no half-written report, no temporary file


def test_the_backend_is_the_runs_unless_named_and_two_recorded_backends_need_the_flag():
    """(Read end to end for a transformers-only family in tests/integration/train/test_hf_targets_e2e.py.)"""
    assert resolve_target_backend(None, [{"target_backend": "transformers"}, {}]) == "transformers"
    assert resolve_target_backend(None, [{}, {"target_backend": ""}]) == "native"
    assert resolve_target_backend("native", [{"target_backend": "transformers"}]) == "native"
    with pytest.raises(ValueError, match=r"^the drafts were trained with targets run by different backends "
                                         r"\(native, transformers\): pass --target-backend$"):
        resolve_target_backend(None, [{"target_backend": "transformers"}, {"target_backend": "native"}])


def test_the_flag_takes_the_backends_a_job_config_takes(capsys):
    """--target-backend and target.backend name the same backends: a draft trained with any
    backend a job accepts can be read with the flag, and a name neither knows is refused."""
    import argparse

    p = argparse.ArgumentParser(prog="eval")
    add_target_backend_arg(p)
    for name in TARGET_BACKENDS:
        assert p.parse_args(["--target-backend", name]).target_backend == name
        cfg = JobConfig()
        cfg.target.backend, cfg.target.path = name, "t"
        validate_job_config(cfg)
    with pytest.raises(SystemExit):
        p.parse_args(["--target-backend", "vllm"])
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


def test_the_report_records_how_the_draft_was_decoded(export_dir, random_target_dir, tmp_path):
    """The proposer's settings, defaults resolved, beside the options given: a report made under
    another default says so."""
    for extra, outside in (((), True), (("--proposer-option", "outside_candidates=false"), False)):
        out = tmp_path / f"report_{outside}.json"
        eval_main(["--target", random_target_dir, "--draft", export_dir, *EVAL, "--temperature", "0.5",
                   "--out", str(out), *extra])
        report = json.loads(out.read_text())
        assert report["proposer_settings"] == {"outside_candidates": outside}
        assert report["proposer_options"] == ({} if outside else {"outside_candidates": False})
