"""End-to-end training on CPU: the trainer learns, resumes exactly, and exports clean keys."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from titan_draft.checkpoint.export import load_export
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer
from helpers import check_exact_resume, debug_job_argv, run_training as _run

BAD_FRAGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp", "embed", "lm_head")


_TARGET: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _target(random_target_dir):
    # debug_random.toml names ./outputs/targets/qwen3_debug; the tests write their own copy
    _TARGET[:] = [random_target_dir]


def _args(dump, data, *extra):
    return debug_job_argv("dflash2", dump, _TARGET[0], data, "--data.max_rows", "0", "--training.local_batch_size", "2",
                          *extra, max_length=128)


def test_debug_job_learns_and_exports(tmp_path, chat_jsonl):
    argv = _args(
        tmp_path, chat_jsonl,
        "--training.steps", "30", "--checkpoint.interval", "15",
        "--metrics.enable_tensorboard", "true", "--profiling.enable_profiling", "true",
        "--profiling.profile_freq", "10",
    )
    losses = _run(argv)
    # Paired control: the same batches and anchors with a zero learning rate. The random-weight
    # target carries no next-token signal, so the draft can only learn token statistics and
    # copying; the fall is modest, and the pairing removes the batch-to-batch noise.
    control = _run(_args(tmp_path / "control", chat_jsonl, "--training.steps", "30",
                         "--optimizer.lr", "0", "--checkpoint.enable", "false"))
    assert all(math.isfinite(v) for v in losses.values())
    window = range(21, 31)  # trained 12.03 against 12.42 frozen (torch 2.13, CPU): a margin of 0.09
    trained = sum(losses[s] for s in window) / len(window)
    frozen = sum(control[s] for s in window) / len(window)
    assert trained < frozen - 0.3, (trained, frozen)
    assert losses[30] < losses[1]

    export = tmp_path / "export"
    tensors, config = load_export(str(export))
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-15", "step-30"]
    assert any(f.startswith("events") for _, _, fs in os.walk(tmp_path / "tb") for f in fs)
    traces = [f for _, _, fs in os.walk(tmp_path / "profile_traces") for f in fs]
    assert any(f.startswith("rank0_trace") for f in traces), traces
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["static_shapes"] is True and info["world_size"] == 1
    assert info["param_dtype"] == "float32" and info["target_dtype"] == "float32"  # CPU runs fp32


def test_resume_matches_uninterrupted(tmp_path, chat_jsonl):
    common = ("--training.steps", "6", "--checkpoint.interval", "3", "--data.prefetch_factor", "2")
    # a half-written newer checkpoint (no .metadata) must be skipped, not loaded
    check_exact_resume(lambda dump: _args(dump, chat_jsonl, *common), tmp_path,
                       before_resume=lambda dump: os.makedirs(dump / "checkpoint" / "step-5"))


def test_packed_resume_matches_uninterrupted(tmp_path, short_chat_jsonl):
    """Killed mid-epoch with packing on (conversations still waiting in the packing window, the
    prefetch thread ahead): the resumed run's losses and export equal the uninterrupted run's."""
    common = ("--training.steps", "6", "--checkpoint.interval", "3", "--data.prefetch_factor", "2",
              "--data.packing", "true", "--data.packing_window", "8")
    check_exact_resume(lambda dump: _args(dump, short_chat_jsonl, *common), tmp_path)


def test_accumulation_divides_by_the_global_denominator(tmp_path, chat_jsonl):
    """Two micro-batches: the gradient is d(sum of both loss sums)/d(w) / (sum of both
    denominators), the exact token-weighted mean, not the mean of per-micro-batch means."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from models.common import full_tensor

    argv = _args(tmp_path, chat_jsonl, "--training.steps", "1", "--training.grad_accum_steps", "2",
                 "--optimizer.lr", "0", "--training.max_norm", "0", "--checkpoint.enable", "false",
                 "--checkpoint.export", "false")
    cfg = ConfigManager().parse_args(argv)
    trainer = Trainer(cfg)
    try:
        # the same weights in a plain (unsharded) module
        reference = trainer.spec.model_cls(trainer.model_args)
        full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        reference.load_state_dict(full, strict=True)
        reference.load_frozen_tables(trainer.model.target_embed, trainer.model.target_lm_head)
        data = iter(trainer.dataloader)
        micro = [next(data), next(data)]
        trainer.train_state.step = 1
        trainer.train_step(micro)
        got = {n: full_tensor(p.grad) for n, p in trainer.model.named_parameters() if p.requires_grad}

        from titan_draft.features.target import compute_features

        outs = [
            reference(compute_features(trainer.target.model, b, trainer.layer_ids, False),
                      generator=trainer._generator(1, i))
            for i, b in enumerate(micro)
        ]
        denoms = [o.loss_denominator for o in outs]
        assert abs(float(denoms[0] - denoms[1])) > 0  # unequal, so the two normalizations differ
        ((outs[0].loss_sum + outs[1].loss_sum) / (denoms[0] + denoms[1])).backward()
        for n, p in reference.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(got[n], full_tensor(p.grad), rtol=1e-4, atol=1e-7, msg=n)
    finally:
        trainer.close()
        destroy_distributed()


LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")


@pytest.fixture(scope="module")
def llama_target_dir(tmp_path_factory):
    """A random-weight Llama-3-architecture HF folder whose tokenizer.json has Llama-3's special
    tokens (on Qwen's BPE ranks: no Llama ranks ship with the tests) and no spare embedding rows,
    so the mask token must be a reserved special token."""
    import tiktoken
    from dataclasses import replace

    from models.targets.llama3 import TARGET_FLAVORS
    from models.targets.qwen3 import Qwen3Model, save_hf_checkpoint
    from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
    from titan_draft.data.tokenizer import Tokenizer, build_tokenizer

    qwen = build_tokenizer("qwen3").encoding
    ranks = qwen._mergeable_ranks
    enc = tiktoken.Encoding(name="llama3-test", pat_str=qwen._pat_str, mergeable_ranks=ranks,
                            special_tokens={t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIALS)})
    tok = Tokenizer("llama3-test", enc, pad_token="<|end_of_text|>", normalizer=None,
                    bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    folder = tmp_path_factory.mktemp("targets") / "llama3_debug"
    args = replace(TARGET_FLAVORS["debugmodel"], vocab_size=enc.n_vocab)
    model = Qwen3Model(args)
    model.init_weights(seed=5)
    save_hf_checkpoint(model, str(folder), dtype=torch.bfloat16)
    save_hf_tokenizer(tok, str(folder))
    (folder / "config.json").write_text(json.dumps(args.to_hf_config()))
    return str(folder), len(ranks) + LLAMA3_SPECIALS.index("<|reserved_special_token_0|>")


def test_llama3_target_trains_with_its_own_tokenizer_format_and_mask(tmp_path, chat_jsonl, llama_target_dir):
    folder, reserved0 = llama_target_dir
    argv = _args(tmp_path, chat_jsonl, "--target.path", folder, "--training.steps", "3",
                 "--checkpoint.enable", "false", "--training.static_shapes", "false")
    cfg = ConfigManager().parse_args(argv)
    trainer = Trainer(cfg)
    try:
        assert trainer.target.family == "llama3" and not trainer.target.args.qk_norm
        assert trainer.run_info["chat_template"] == "llama3"
        assert trainer.model_args.mask_token_id == reserved0  # no spare rows: a reserved token
        batch = next(iter(trainer.dataloader))
        text = trainer.tokenizer.decode(batch["input_ids"][0, : int(batch["valid_lengths"][0])].tolist())
        assert text.startswith("<|begin_of_text|><|start_header_id|>")
        header = {trainer.tokenizer.token_id(t) for t in ("<|start_header_id|>", "<|end_header_id|>")}
        eot = trainer.tokenizer.token_id("<|eot_id|>")
        for ids, mask, n in zip(batch["input_ids"], batch["loss_mask"], batch["valid_lengths"]):
            trained = ids[mask].tolist()
            assert trained and not header & set(trained)
            if n < cfg.data.max_length:  # not truncated: the answer ends with its <|eot_id|>
                assert trained[-1] == eot
        losses = trainer.train()
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses.values())
    finally:
        trainer.close()
        destroy_distributed()
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert json.dumps(config).count(f'"mask_token_id": {reserved0}') >= 1


def test_a_setting_that_reads_the_targets_last_hidden_gets_it(tmp_path, chat_jsonl):
    """DFlash2's soft_labels reads TargetFeatures.last_hidden: the job's features carry it (the
    ModelSpec's needs_last_hidden_fn, not the constant) and a step trains on it."""
    argv = _args(tmp_path, chat_jsonl, "--training.steps", "1", "--checkpoint.enable", "false",
                 "--checkpoint.export", "false", "--model.args.soft_labels", "true")
    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        assert trainer.needs_last_hidden and not trainer.spec.needs_last_hidden
        batch = next(iter(trainer.dataloader))
        features = trainer.features_fn(batch)
        assert features.last_hidden is not None and features.last_hidden.shape[:2] == batch["input_ids"].shape
        trainer.train_state.step = 1
        trainer.train_step([batch])
        assert all(p.grad is not None for n, p in trainer.model.named_parameters() if p.requires_grad)
    finally:
        trainer.close()
        destroy_distributed()
