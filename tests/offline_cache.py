"""Test helpers for offline mode: a job's argv, a feature cache prepared from it in-process, and
the same rows through the online target and through the cache."""

from __future__ import annotations

from dataclasses import replace

import torch

from scripts.prepare_features import prepare
from titan_draft.data.chat.format import build_chat_format
from titan_draft.features.offline import features_from_batch, load_feature_cache
from titan_draft.features.target import build_target, build_target_tokenizer, compute_features
from titan_draft.config import ConfigManager
from titan_draft.data.pipeline import build_dataloader
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.protocols import get_model_spec
from titan_draft.components.model_args import resolve_model_args
from trainer_runs import REPO, debug_job_argv  # noqa: F401  (REPO: the tests import it from here)


def registered_drafts() -> list[str]:
    """Every draft a package under models/ registers (not the throwaway ones tests define)."""
    from titan_draft.protocols import model_spec
    from titan_draft.protocols.discovery import import_model_packages

    import_model_packages()
    return sorted(n for n, s in model_spec._REGISTRY.items() if s.model_cls.__module__.startswith("models."))


def job_argv(draft: str, dump, target: str, data: str, *extra: str) -> list[str]:
    """A small, fast, unshuffled job of ``draft``'s debug config (no checkpoints, no export)."""
    return debug_job_argv(draft, dump, target, data, "--data.max_rows", "20", "--data.shuffle", "false",
                          "--training.local_batch_size", "2", "--checkpoint.enable", "false",
                          "--checkpoint.export", "false", "--eval.enable", "false", *extra, max_length=48)


def prepare_cache(out, argv: list[str], *options: str) -> dict:
    """scripts/prepare_features.py in this process (one rank); its manifest."""
    try:
        return prepare(["--out", str(out), *options, *argv])
    finally:
        destroy_distributed()


class Paths:
    """One job's online batches/features and offline batches/features, side by side."""

    def __init__(self, argv: list[str]):
        cfg = self.cfg = ConfigManager().parse_args(argv)
        self.spec = get_model_spec(cfg.model.name)
        self.target = build_target(cfg, torch.device("cpu"), torch.float32)
        self.tokenizer = build_target_tokenizer(cfg, self.target.args.vocab_size)
        self.chat = build_chat_format(cfg.data, self.tokenizer)
        args = resolve_model_args(self.spec, cfg, self.target.args, self.tokenizer, self.chat)
        self.layer_ids = list(self.spec.capture_layers_fn(args))
        fn = self.spec.reserved_tokens_fn
        self.reserved = list(fn(args)) if fn is not None else []

    def online(self):
        t = self.cfg.training
        loader = build_dataloader(self.cfg.data, self.tokenizer, dp_rank=0, dp_world=1,
                                  local_batch_size=t.local_batch_size, seed=t.seed, static_shapes=t.static_shapes,
                                  reserved_ids=frozenset(self.reserved))
        for batch in loader:
            yield batch, compute_features(self.target.model, batch, self.layer_ids, self.spec.needs_last_hidden)

    def offline(self, cache: str, *, dp_rank: int = 0, dp_world: int = 1, shuffle: bool | None = None):
        data = replace(self.cfg.data, feature_cache=cache)
        if shuffle is not None:
            data.shuffle = shuffle
        cfg = replace(self.cfg, data=data)
        load_feature_cache(cfg, self.target, self.tokenizer, self.chat, layer_ids=self.layer_ids,
                           need_last_hidden=self.spec.needs_last_hidden, reserved_ids=self.reserved,
                           dp_rank=dp_rank, dp_world=dp_world)
        t = cfg.training
        return build_dataloader(cfg.data, self.tokenizer, chat=self.chat, dp_rank=dp_rank, dp_world=dp_world,
                                local_batch_size=t.local_batch_size, seed=t.seed, static_shapes=t.static_shapes,
                                layer_ids=self.layer_ids, need_last_hidden=self.spec.needs_last_hidden)

    @staticmethod
    def features(batch):
        return features_from_batch(batch, torch.float32)
