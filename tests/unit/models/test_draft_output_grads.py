"""A draft's output must expose its loss to FSDP2's backward hooks, and a step in which no
trainable parameter gets a gradient must stop the run instead of training on nothing.

On torch 2.11 (the H200's), FSDP2 finds the output tensors of a unit with pytree's
``tree_flatten``; an unregistered dataclass is one opaque leaf there, so EAGLE-3 (whose whole draft
is one FSDP unit, the root) got no gradient at all. torch 2.13 traverses dataclasses itself, so the
first test checks the pytree contract directly, not through FSDP."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.protocols import DraftOutput, TargetFeatures
from titan_draft.protocols import model_spec
from titan_draft.train import Trainer

from tests.integration.train.test_fourth_draft import SPEC, ProbeDraft, probe_argv


def test_tree_flatten_reaches_the_loss_and_metrics_of_a_draft_output():
    loss = torch.tensor(2.0, requires_grad=True) * 3
    num, den = torch.tensor(1.0), torch.tensor(4.0)
    out = DraftOutput(loss_sum=loss, loss_denominator=torch.tensor(5.0), metrics={"acc": (num, den)})
    leaves, spec = tree_flatten(out)
    # the very tensor backward starts from is a leaf, so a hook registered on leaves sees it
    assert any(leaf is loss for leaf in leaves)
    assert any(leaf is num for leaf in leaves) and any(leaf is den for leaf in leaves)
    back = tree_unflatten(leaves, spec)
    assert isinstance(back, DraftOutput) and back.loss_sum is loss and back.metrics["acc"][1] is den


class _DetachedDraft(ProbeDraft):
    """Its loss depends on the features only: backward runs, no parameter gets a gradient."""

    def forward(self, features: TargetFeatures, *, generator=None) -> DraftOutput:
        out = super().forward(features, generator=generator)
        loss = features.aux_hidden.float().sum() * 0 + torch.ones((), requires_grad=True)
        return replace(out, loss_sum=loss)


def test_a_step_without_any_gradient_stops_with_one_line(tmp_path, random_target_dir, chat_jsonl, monkeypatch):
    # registered for this test only: other tests list the registered drafts
    monkeypatch.setitem(model_spec._REGISTRY, "detached_draft_test",
                        replace(SPEC, name="detached_draft_test", model_cls=_DetachedDraft))
    argv = probe_argv(str(tmp_path), random_target_dir, chat_jsonl, "detached_draft_test", "--checkpoint.enable", "false")
    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        with pytest.raises(RuntimeError, match="step 1: no trainable parameter of the draft received a gradient"):
            trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
