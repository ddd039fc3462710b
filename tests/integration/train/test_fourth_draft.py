"""The draft contract: a throwaway draft defined here, in a test file, registers a ModelSpec and
trains and exports through the unchanged engine."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from titan_draft.checkpoint.export import load_export
from titan_draft.config import ConfigManager
from titan_draft.distributed.parallelize import parallelize_blocks
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.protocols import DraftOutput, ModelSpec, TargetFeatures
from titan_draft.protocols.model_spec import register_model_spec
from titan_draft.train import Trainer
from helpers import REPO


@dataclass
class ProbeArgs:
    hidden_size: int = 64
    vocab_size: int = 0
    capture: list[int] = field(default_factory=list)


class ProbeBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x):
        return x + self.proj(x)


class ProbeDraft(nn.Module):
    """Predicts token t+1 from the target's layer feature at t through the frozen lm_head."""

    def __init__(self, args: ProbeArgs):
        super().__init__()
        self.args = args
        self.blocks = nn.ModuleDict({"0": ProbeBlock(args.hidden_size)})
        self.register_buffer("head", torch.empty(0, args.hidden_size), persistent=False)

    def init_weights(self):
        nn.init.normal_(self.blocks["0"].proj.weight, std=0.02)

    def load_frozen_tables(self, embed_weight, lm_head_weight):
        self.register_buffer("head", lm_head_weight.detach().clone(), persistent=False)

    def set_train_progress(self, step, total_steps):
        pass

    def forward(self, features: TargetFeatures, *, generator=None) -> DraftOutput:
        h = self.blocks["0"](features.aux_hidden[:, :-1])
        logits = h.to(self.head.dtype) @ self.head.t()
        labels = features.input_ids[:, 1:]
        w = features.loss_mask[:, 1:].to(logits.dtype)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        loss_sum = (ce * w.flatten()).sum()
        hits = ((logits.argmax(-1) == labels).to(w.dtype) * w).sum()
        return DraftOutput(loss_sum=loss_sum, loss_denominator=w.sum().detach(),
                           metrics={"acc": (hits.detach(), w.sum().detach())})


def _update(args, ctx):
    t = ctx.target
    return replace(args, hidden_size=t.hidden_size, vocab_size=t.vocab_size, capture=[t.num_hidden_layers - 1])


def _export(state, args, target_info):
    return dict(state), {"architectures": ["ProbeDraft"], "capture": args.capture}


SPEC = ModelSpec(
    name="probe_draft_test",
    flavors={"tiny": ProbeArgs()},
    model_cls=ProbeDraft,
    parallelize_fn=lambda model, dims, job, *, dp_mesh=None: parallelize_blocks(model, job, dp_mesh,
                                                                                blocks=model.blocks),
    update_args_fn=_update,
    capture_layers_fn=lambda args: list(args.capture),
    export_fn=_export,
)


def probe_argv(dump: str, target: str, data: str, name: str, *extra: str) -> list[str]:
    """Two steps of a registered test draft (flavor ``tiny``) on the random target."""
    return ["--job.config_file", os.path.join(REPO, "train_configs", "debug_random.toml"),
            "--job.dump_folder", dump, "--target.path", target, "--data.source", data,
            "--model.name", name, "--model.flavor", "tiny", "--training.steps", "2",
            "--data.max_length", "64", "--metrics.enable_tensorboard", "false",
            "--profiling.enable_profiling", "false", *extra]


def test_a_draft_from_a_test_folder_trains_and_exports(tmp_path, random_target_dir, chat_jsonl):
    register_model_spec(SPEC)
    argv = probe_argv(str(tmp_path), random_target_dir, chat_jsonl, "probe_draft_test", "--checkpoint.interval", "2")
    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        losses = trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    tensors, config = load_export(str(tmp_path / "export"))
    assert sorted(tensors) == ["blocks.0.proj.weight"] and config == {"architectures": ["ProbeDraft"], "capture": [5]}
    assert os.path.isdir(tmp_path / "checkpoint" / "step-2")
