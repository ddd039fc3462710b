"""A job that cannot get a usable target stops before start-up, with the key named."""

from __future__ import annotations

import json

import pytest

from titan_draft.components.target import check_target_config
from titan_draft.config import ConfigManager


def _cfg(*argv):
    return ConfigManager().parse_args(list(argv))


def _folder(tmp_path, config):
    tmp_path.mkdir(exist_ok=True)
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_random_target_and_qwen3_folder_pass(tmp_path):
    check_target_config(_cfg())  # the debug default: a random-weight debugmodel target
    check_target_config(_cfg("--target.path", _folder(tmp_path, {"model_type": "qwen3"})))


@pytest.mark.parametrize(
    "argv, config, message",
    [
        (["--target.flavor", ""], None, "target.path is required"),
        (["--target.path", "/no/such/folder"], None, "does not exist"),
        (["--target.path", "FOLDER"], None, "has no config.json"),
        (["--target.path", "FOLDER"], {"model_type": "mistral"}, "model_type 'mistral'"),
        (["--target.path", "FOLDER"], {"model_type": "llama"}, "only Qwen3 targets"),
    ],
)
def test_unusable_targets_are_refused(tmp_path, argv, config, message):
    folder = _folder(tmp_path / "t", config)
    argv = [folder if a == "FOLDER" else a for a in argv]
    with pytest.raises(ValueError, match=message):
        check_target_config(_cfg(*argv))
