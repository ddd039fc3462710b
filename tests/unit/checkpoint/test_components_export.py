"""export_draft / load_export: serving names, dtypes, provenance, refusal of wrapper prefixes."""

import json
import os

import pytest
import torch
from torch import nn

from titan_draft.checkpoint.export import (
    PROVENANCE_NAME,
    export_draft,
    exported_step,
    load_export,
    read_provenance,
    recorded_target,
)


class TinyDraft(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4, bias=False)
        self.layers = nn.ModuleDict({"0": nn.Linear(4, 4)})
        self.register_buffer("d2t", torch.arange(5, dtype=torch.int64))  # vocab map stays int
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def tiny_export_fn(state_dict, model_args, target_info):
    """Renames to serving names, emits one non-contiguous tensor and one tied (shared) tensor."""
    tensors = {
        "fc.weight": state_dict["fc.weight"],
        "midlayer.proj.weight": state_dict["layers.0.weight"].t(),  # non-contiguous view
        "midlayer.proj.bias": state_dict["layers.0.bias"],
        "midlayer.proj.bias_tied": state_dict["layers.0.bias"],  # same storage
        "d2t": state_dict["d2t"],
    }
    config = {"architectures": ["TinyDraft"], "hidden_size": model_args["hidden"], **target_info}
    return tensors, config


def test_export_writes_clean_files_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = TinyDraft()
    out = export_draft(
        model, tiny_export_fn, {"hidden": 4}, {"target_model_type": "qwen3"}, str(tmp_path / "export"),
        dtype="bfloat16", extra_config={"step": 42, "capture_layers": [1, 5, 9]},
    )
    assert out == str(tmp_path / "export")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "titan_draft_export.json"]
    tensors, config = load_export(out)
    assert config == {"architectures": ["TinyDraft"], "hidden_size": 4, "target_model_type": "qwen3"}
    assert sorted(tensors) == sorted(["fc.weight", "midlayer.proj.weight", "midlayer.proj.bias",
                                      "midlayer.proj.bias_tied", "d2t"])
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], torch.arange(5))
    assert torch.equal(tensors["midlayer.proj.weight"], model.layers["0"].weight.detach().t().bfloat16())
    assert torch.equal(tensors["fc.weight"], model.fc.weight.detach().bfloat16())
    assert torch.equal(tensors["midlayer.proj.bias_tied"], tensors["midlayer.proj.bias"])
    with open(os.path.join(out, "titan_draft_export.json")) as f:
        prov = json.load(f)
    assert prov["step"] == 42 and prov["capture_layers"] == [1, 5, 9]
    assert prov["export_dtype"] == "bfloat16" and prov["num_tensors"] == 5
    assert not any(name.endswith(".tmp") for name in os.listdir(out))


def test_float32_export_with_tied_tensors(tmp_path):
    # No cast means no copy: tied tensors still share storage and must not trip safetensors.
    tensors, _ = load_export(export_draft(TinyDraft(), tiny_export_fn, {"hidden": 4}, {},
                                          str(tmp_path), dtype="float32"))
    assert tensors["fc.weight"].dtype == torch.float32


def test_wrapper_prefixes_are_refused(tmp_path):
    def leaky(state_dict, model_args, target_info):
        return {"_orig_mod.fc.weight": state_dict["fc.weight"]}, {}

    with pytest.raises(ValueError, match="_orig_mod.fc.weight"):
        export_draft(TinyDraft(), leaky, {}, {}, str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "a")

    class FsdpLeak(nn.Module):
        def __init__(self):
            super().__init__()
            self._fsdp_wrapped_module = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="_fsdp_wrapped_module.weight"):
        export_draft(FsdpLeak(), lambda sd, a, t: (sd, {}), {}, {}, str(tmp_path / "b"))


def test_non_rank0_writes_nothing_and_bad_inputs(tmp_path):
    assert export_draft(TinyDraft(), tiny_export_fn, {"hidden": 4}, {}, str(tmp_path / "x"),
                        is_rank0=False) is None
    assert not os.path.exists(tmp_path / "x")
    with pytest.raises(ValueError, match="dtype"):
        export_draft(TinyDraft(), tiny_export_fn, {"hidden": 4}, {}, str(tmp_path / "y"), dtype="int8")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_export(str(tmp_path))


def test_provenance_is_read_back_and_an_unreadable_one_is_named(tmp_path):
    out = export_draft(TinyDraft(), tiny_export_fn, {"hidden": 4}, {}, str(tmp_path / "e"),
                       extra_config={"step": 7, "run": {"draft": "tiny"}, "target": {"family": "qwen3"}})
    assert read_provenance(out)["run"] == {"draft": "tiny"}
    assert exported_step(out) == 7 and recorded_target(out) == {"family": "qwen3"}
    # none kept (a DCP step folder, another tool's export): nothing recorded, nothing to check
    assert read_provenance(str(tmp_path)) == {} and recorded_target(str(tmp_path)) is None
    path = os.path.join(out, PROVENANCE_NAME)
    for text, why in (('{"step": 7, "tar', "not valid JSON: Unterminated string"),
                      ("[7]", "expected a JSON object at the top level")):
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=rf"^{path}: {why}"):
            read_provenance(out)
        # the target it records is checked against, never skipped because the file broke
        with pytest.raises(ValueError, match=rf"^{path}: {why}"):
            recorded_target(out)
        assert exported_step(out) is None  # so a run exports again rather than trusting it


def test_a_draft_folder_with_unreadable_records_is_one_line(tmp_path):
    """--draft read back: an export's provenance and a DCP step's run info go through one reader,
    each failure one line naming the file."""
    from titan_draft.checkpoint.draft_source import load_draft_source

    out = export_draft(TinyDraft(), tiny_export_fn, {"hidden": 4}, {}, str(tmp_path / "e"))
    with open(os.path.join(out, PROVENANCE_NAME), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match=rf"^--draft: {os.path.join(out, PROVENANCE_NAME)}: not valid JSON: "):
        load_draft_source(out, None)
    step = tmp_path / "dump" / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (tmp_path / "dump" / "run_info.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"^--draft: .*run_info\.json: expected a JSON object at the top level$"):
        load_draft_source(str(step), None)
