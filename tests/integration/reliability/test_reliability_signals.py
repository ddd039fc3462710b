"""SIGTERM / SIGINT: the step finishes, is saved, the run exits 0 saying where to resume; a
second signal exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from titan_draft.components.signals import maybe_handle_stop_signals
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer
from helpers import REPO, job_args, run_training


def _signal_at(monkeypatch, trainer, step, signum):
    """Deliver ``signum`` to this process in the middle of ``step`` (while the target runs)."""
    real = trainer.features_fn

    def hooked(*args, **kwargs):
        if trainer.train_state.step == step:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "features_fn", hooked)


def _stopped_run(dump, chat_jsonl, random_target_dir, monkeypatch, signum, common):
    trainer = Trainer(ConfigManager().parse_args(job_args(dump, chat_jsonl, random_target_dir, *common)))
    _signal_at(monkeypatch, trainer, 2, signum)
    try:
        losses = trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    monkeypatch.undo()
    assert sorted(losses) == [1, 2]  # step 2 finished, step 3 never started
    name = signal.Signals(signum).name
    assert trainer.stop_line.startswith(f"stopped by {name} after step 2 of {common[1]}: checkpoint "), trainer.stop_line
    assert "resume from step 2" in trainer.stop_line
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-2"]
    assert not (dump / "export").exists()


def test_sigterm_saves_the_step_and_resume_matches(tmp_path, chat_jsonl, random_target_dir, monkeypatch):
    common = ("--training.steps", "4", "--checkpoint.interval", "100")
    full = run_training(job_args(tmp_path / "full", chat_jsonl, random_target_dir, *common))
    dump = tmp_path / "stopped"
    _stopped_run(dump, chat_jsonl, random_target_dir, monkeypatch, signal.SIGTERM, common)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
    resumed = run_training(job_args(dump, chat_jsonl, random_target_dir, *common))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step
    assert (dump / "export" / "model.safetensors").exists()
    assert not (dump / ".titan_draft.lock").exists()  # a clean end leaves no lock file behind


def test_sigint_stops_the_same_way(tmp_path, chat_jsonl, random_target_dir, monkeypatch):
    _stopped_run(tmp_path, chat_jsonl, random_target_dir, monkeypatch, signal.SIGINT,
                 ("--training.steps", "4", "--checkpoint.interval", "100"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_second_signal_exits_at_once():
    script = textwrap.dedent("""
        import os, signal, time
        from titan_draft.components.signals import maybe_handle_stop_signals
        with maybe_handle_stop_signals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested() and stop.name == "SIGTERM"
            os.kill(os.getpid(), signal.SIGINT)  # at once: the same request forwarded by a launcher
            print("first handled", flush=True)
            time.sleep(1.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("not reached", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stdout.strip() == "first handled"
    assert "second SIGTERM: exiting now" in proc.stderr


def test_no_signal_no_stop():
    with maybe_handle_stop_signals() as stop:
        assert not stop.requested()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_command_line_exits_0_with_the_resume_line(tmp_path, chat_jsonl, random_target_dir):
    """`python -m titan_draft.train` got SIGTERM mid-run: exit status 0, and its last line says
    where to resume."""
    argv = job_args(tmp_path, chat_jsonl, random_target_dir, "--training.steps", "200", "--checkpoint.interval", "1000")
    proc = subprocess.Popen([sys.executable, "-m", "titan_draft.train", *argv], cwd=REPO, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": REPO})
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if " step 2/200 " in line:
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stderr.readlines()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, "".join(lines[-30:])
    last = lines[-1].strip()
    assert last.startswith("titan_draft: stopped by SIGTERM after step ") and "run the same command again" in last, last
    step = int(last.split("after step ")[1].split(" ")[0])
    assert os.path.isfile(tmp_path / "checkpoint" / f"step-{step}" / ".metadata")


def test_a_stop_during_the_final_export_lets_it_finish(tmp_path, chat_jsonl, random_target_dir):
    """The last step is done and the export is being written when SIGTERM comes (a launcher's
    stop, a closed terminal): the export finishes and the run ends well, instead of dying
    half-written."""
    argv = job_args(tmp_path, chat_jsonl, random_target_dir, "--training.steps", "2")
    script = textwrap.dedent(f"""
        import os, signal
        from titan_draft.cli import run_cli
        from titan_draft.train import Trainer

        def build(cfg):
            trainer = Trainer(cfg)
            export = trainer._export

            def stopped_export():
                os.kill(os.getpid(), signal.SIGTERM)
                export()
            trainer._export = stopped_export
            return trainer

        run_cli(build, {argv!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert proc.stderr.strip().splitlines()[-1].endswith(f"exported draft to {tmp_path}/export"), proc.stderr[-2000:]
