"""A job that cannot get a usable target or tokenizer stops before start-up, with the key named;
the trainer takes its tokenizer, chat format and mask token from the target."""

from __future__ import annotations

import json
import shutil

import pytest

from titan_draft.features.target import build_target_tokenizer, check_target_config
from titan_draft.config import ConfigManager
from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
from titan_draft.data.tokenizer import build_tokenizer


def _cfg(*argv):
    return ConfigManager().parse_args(list(argv))


@pytest.fixture(scope="module", autouse=True)
def _qwen_tokenizer_files(tmp_path_factory):
    global _TOKENIZER_DIR
    _TOKENIZER_DIR = tmp_path_factory.mktemp("tok")
    save_hf_tokenizer(build_tokenizer("qwen3"), str(_TOKENIZER_DIR))  # written once: ~1 s


def _folder(path, config, tokenizer=False):
    path.mkdir(exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        for f in _TOKENIZER_DIR.iterdir():
            shutil.copy(f, path / f.name)
    return str(path)


QWEN3 = {"model_type": "qwen3", "vocab_size": 151936}


def test_random_target_and_qwen3_folder_pass(tmp_path):
    check_target_config(_cfg())  # the debug default: a random-weight debugmodel target
    folder = _folder(tmp_path / "q", QWEN3, tokenizer=True)
    check_target_config(_cfg("--target.path", folder))
    # Llama-3 targets are no longer refused: their tokenizer comes from their folder too
    check_target_config(_cfg("--target.path", _folder(tmp_path / "l", {**QWEN3, "model_type": "llama"}, True)))


def test_tokenizer_comes_from_the_target(tmp_path):
    folder = _folder(tmp_path / "q", QWEN3, tokenizer=True)
    tok = build_target_tokenizer(_cfg("--target.path", folder), 151936)
    assert tok.name == folder and tok.encoding.n_vocab == build_tokenizer("qwen3").n_vocab
    assert build_target_tokenizer(_cfg(), 151936).name == "qwen3"  # random target: packaged BPE
    bare = _folder(tmp_path / "bare", QWEN3)
    # a folder without tokenizer files, rescued by target.tokenizer
    assert build_target_tokenizer(_cfg("--target.path", bare, "--target.tokenizer", folder), 151936).name == folder


@pytest.mark.parametrize(
    "argv, config, tokenizer, message",
    [
        (["--target.flavor", ""], None, False, "target.path is required"),
        (["--target.path", "/no/such/folder"], None, False, "does not exist"),
        (["--target.path", "FOLDER"], None, False, "has no config.json"),
        (["--target.path", "FOLDER"], {"model_type": "mistral"}, True, "model_type 'mistral'"),
        (["--target.path", "FOLDER"], {**QWEN3, "quantization_config": {"quant_method": "awq"}}, True,
         r"quantized checkpoint \(awq\)"),
        (["--target.path", "FOLDER"], QWEN3, False, r"target.path: .*no tokenizer.json.*target.tokenizer"),
        (["--target.path", "FOLDER", "--target.tokenizer", "/no/tok"], QWEN3, True,
         r"target.tokenizer: unknown tokenizer '/no/tok'"),
        (["--target.path", "FOLDER"], {**QWEN3, "vocab_size": 32000}, True,
         r"target.path: tokenizer .* has 151669 ids but the target has 32000 embedding rows"),
    ],
)
def test_unusable_targets_are_refused(tmp_path, argv, config, tokenizer, message):
    folder = _folder(tmp_path / "t", config, tokenizer)
    argv = [folder if a == "FOLDER" else a for a in argv]
    with pytest.raises(ValueError, match=message):
        check_target_config(_cfg(*argv))


def test_mask_token_comes_from_the_tokenizer_unless_set():
    from models.targets.qwen3 import qwen3_flavors
    from titan_draft.protocols.model_spec import get_model_spec
    from titan_draft.components.model_args import resolve_model_args
    from titan_draft.data.chat.format import build_chat_format

    spec, target = get_model_spec("dflash2"), qwen3_flavors["debugmodel"]
    tok = build_tokenizer("qwen3")
    auto = resolve_model_args(spec, _cfg(), target, tok, build_chat_format(_cfg().data, tok))
    assert auto.mask_token_id == tok.unused_token_id(target.vocab_size) == 151669
    cfg = _cfg("--model.args.mask_token_id", "151700")
    assert resolve_model_args(spec, cfg, target, tok, build_chat_format(cfg.data, tok)).mask_token_id == 151700
