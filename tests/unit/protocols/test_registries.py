"""The engine reaches drafts and targets only through their registered specs."""

from __future__ import annotations

import ast
import os

import pytest

from titan_draft.protocols.target_spec import (
    TargetSpec,
    get_target_spec,
    random_target_args,
    register_target_spec,
    target_spec_for_model_type,
)

from helpers import REPO

ENGINE = os.path.join(REPO, "titan_draft")


def test_engine_imports_no_model_package():
    """No module of titan_draft/ imports models.* (lazily or not); the registries find the
    packages through discovery."""
    offenders = []
    for root, _, files in os.walk(ENGINE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            for node in ast.walk(ast.parse(open(path).read())):
                mods = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module]
                elif isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                offenders += [f"{path}: {m}" for m in mods if m.startswith("models.")]
    assert offenders == []


def test_target_families_by_model_type():
    assert target_spec_for_model_type("qwen3", "x").family == "qwen3"
    assert target_spec_for_model_type("llama", "x").family == "llama3"
    assert target_spec_for_model_type("qwen2", "x").family == "qwen2"
    assert target_spec_for_model_type("qwen3_moe", "x").family == "qwen3_moe"
    with pytest.raises(ValueError, match=r"x has model_type 'mistral'; supported: \['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
        target_spec_for_model_type("mistral", "x")
    with pytest.raises(ValueError, match=r"target.family: 'gpt2' is not a registered target family"):
        get_target_spec("gpt2")
    assert random_target_args("llama3", "debugmodel").qk_norm is False
    with pytest.raises(ValueError, match="'huge' is not a qwen3 target flavor"):
        random_target_args("qwen3", "huge")
    spec = get_target_spec("qwen3")
    clash = TargetSpec(family="qwen3_copy", model_types=("qwen3",), model_cls=spec.model_cls,
                       args_from_hf_config=spec.args_from_hf_config, load_hf_state_dict=spec.load_hf_state_dict)
    with pytest.raises(ValueError, match=r"model_type\(s\) \['qwen3'\] belong to 'qwen3'"):
        register_target_spec(clash)
    with pytest.raises(ValueError, match="already registered"):
        register_target_spec(spec)


def test_unknown_draft_lists_the_registered_ones():
    from titan_draft.protocols import get_model_spec

    with pytest.raises(ValueError, match=r"unknown model.name 'eagle9'; registered drafts: \[.*'dflash2'"):
        get_model_spec("eagle9")
