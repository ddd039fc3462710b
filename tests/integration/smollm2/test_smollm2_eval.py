"""The true-τ eval on the real SmolLM2-135M-Instruct (fp32, CPU): lossless with a random, a
scripted and a trained draft; the eval CLI on the export and on the DCP checkpoint measures what
training measured; what the run records (mask token, export config) follows the target."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from models.dflash2.args import dflash2_flavors
from models.dflash2.model import DFlash2Draft
from models.dflash2.proposal import DFlashProposer
from titan_draft import load_target
from titan_draft.decoding.acceptance import evaluate
from titan_draft.checkpoint.export import load_export
from titan_draft.decoding.speculative import greedy_decode
from titan_draft.config import ConfigManager
from titan_draft.data.chat.prompts import load_eval_prompts, stop_token_ids
from titan_draft.data.tokenizer import build_tokenizer
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.eval import main as eval_main
from titan_draft.train import Trainer
from helpers import REPO
from helpers import GreedyDrafter

CPU = torch.device("cpu")
NEW = 24


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    tok = build_tokenizer(smollm2_dir)
    prompts = load_eval_prompts(["mtbench"], tok, template="chatml", enable_thinking=False, num_prompts=2,
                                system_prompt="You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    return load_target(smollm2_dir, dtype=torch.float32), tok, prompts


def test_random_draft_is_lossless(smollm2):
    target, tok, prompts = smollm2
    args = replace(dflash2_flavors["smollm2"], num_layers=1, vocab_size=49152, target_layer_ids=[15],
                   num_target_layers=30, mask_token_id=16)
    torch.manual_seed(0)
    draft = DFlash2Draft(args)
    draft.init_weights()
    draft.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    report = evaluate(target, DFlashProposer(draft.eval()), prompts, max_new_tokens=NEW,
                      stop_ids=stop_token_ids(tok, "chatml"), device=CPU)
    assert report.lossless == 2 and report.tau >= 1.0


class AlmostRight(GreedyDrafter):
    """Drafts the target's greedy continuation but gets its third token wrong: every round
    accepts exactly two tokens."""

    num_draft_tokens, capture_layers, needs_last_hidden = 3, [27], False

    def __init__(self, prompt, truth):
        self.prompt, self.truth, self.n = prompt, truth, 0

    def reset(self, max_len):
        self.n = 0

    def commit(self, token_ids, aux, last_hidden):
        assert aux.shape == (len(token_ids), 576)
        self.n += len(token_ids)

    def propose(self, last_token):
        i = self.n - len(self.prompt)
        nxt = (self.truth[i + 1 : i + 4] + [0, 0, 0])[:3]
        return torch.tensor([nxt[0], nxt[1], (nxt[2] + 1) % 49152])


def test_scripted_draft_on_the_real_model(smollm2):
    target, tok, prompts = smollm2
    prompt = prompts[0].ids
    truth = greedy_decode(target, prompt, 40, [], CPU).tokens
    report = evaluate(target, AlmostRight(prompt, truth), [prompts[0]], max_new_tokens=31, stop_ids=[],
                      device=CPU)
    assert report.tau == 3.0 and report.accept_rate() == [1.0, 1.0, 0.0] and report.lossless == 1


def test_trained_draft_lossless_and_the_eval_cli_agrees(smollm2_dir, chat_jsonl, tmp_path, capsys):
    """The default job, shortened: train on real chats, eval at the end; then the CLI on the
    export and on the checkpoint measures the same τ, token for token."""
    dump = tmp_path / "run"
    argv = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
            "--job.dump_folder", str(dump), "--target.path", smollm2_dir, "--data.source", chat_jsonl,
            # nothing here needs the draft to have learned: a few small steps keep the suite short
            "--training.steps", "4", "--checkpoint.interval", "4", "--training.local_batch_size", "2",
            "--data.max_length", "128", "--metrics.enable_tensorboard", "false",
            "--profiling.enable_profiling", "false", "--eval.num_prompts", "2", "--eval.max_new_tokens", str(NEW)]
    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    live = json.loads((dump / "eval" / "step-4.json").read_text())
    assert live["summary"]["lossless_prompts"] == 2
    info = json.loads((dump / "run_info.json").read_text())
    assert info["reserved_tokens"] == [[16, "<empty_output>"]] and info["eval_prompts"][0] == "mtbench:81"
    assert info["system_prompt"].startswith("You are a helpful AI assistant named SmolLM")
    tensors, config = load_export(str(dump / "export"))
    assert config["torch_dtype"] == "bfloat16" and {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert (config["max_position_embeddings"], config["rope_theta"], config["rms_norm_eps"]) == (8192, 1e5, 1e-5)
    assert config["dflash_config"]["mask_token_id"] == 16 and config["block_size"] == 4

    # The checkpoint holds the fp32 weights that the live eval used: identical decoding. The
    # export is bf16: its report must be lossless too, on its own decodes.
    for draft, same in ((dump / "checkpoint" / "step-4", True), (dump / "export", False)):
        out = tmp_path / f"{draft.name}.json"
        # the second eval reads the first one's plain greedy decodes (the lossless check's reference)
        eval_main(["--target", smollm2_dir, "--draft", str(draft), "--num-prompts", "2",
                   "--max-new-tokens", str(NEW), "--greedy-cache", str(tmp_path / "greedy.json"), "--out", str(out)])
        got = json.loads(out.read_text())
        assert got["summary"]["lossless_prompts"] == 2
        assert [p["name"] for p in got["prompts"]] == [p["name"] for p in live["prompts"]]
        if same:
            for a, b in zip(got["prompts"], live["prompts"]):
                assert (a["accepted"], a["new_tokens"]) == (b["accepted"], b["new_tokens"])
    assert "true acceptance length" in capsys.readouterr().out


def test_random_eagle3_draft_is_lossless(smollm2):
    """EAGLE-3's chain proposal on the real model (random weights: rejected, but every round
    must still leave the output equal to plain greedy decoding)."""
    from models.eagle3 import Eagle3Draft, Eagle3Proposer, eagle3_flavors

    target, tok, prompts = smollm2
    args = replace(eagle3_flavors["smollm2"], vocab_size=49152, draft_vocab_size=4096, ttt_steps=3,
                   target_layer_ids=[1, 14, 26], num_target_layers=30)
    torch.manual_seed(0)
    draft = Eagle3Draft(args)
    draft.init_weights()
    draft.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    report = evaluate(target, Eagle3Proposer(draft.eval()), prompts, max_new_tokens=NEW,
                      stop_ids=stop_token_ids(tok, "chatml"), device=CPU)
    assert report.lossless == 2 and report.num_draft_tokens == 3


def test_random_dspark_draft_is_lossless(smollm2, kind="gated", threshold=0.3):
    """DSpark's proposal (block forward, then the gated Markov head left to right, cut where the
    confidence product falls below the threshold) on the real model: random weights are mostly
    rejected, and every round must still leave the output equal to plain greedy. (The rnn head's
    decoding is checked against training in tests/unit/models/dspark/test_models_dspark.py.)"""
    from models.dspark import DSparkDraft, DSparkProposer, dspark_flavors

    target, tok, prompts = smollm2
    args = replace(dspark_flavors["smollm2"], num_layers=1, vocab_size=49152, target_layer_ids=[15],
                   num_target_layers=30, mask_token_id=16, block_size=4, markov_head_type=kind, markov_rank=32)
    torch.manual_seed(0)
    draft = DSparkDraft(args)
    draft.init_weights()
    with torch.no_grad():  # a Markov bias that matters (it starts at zero)
        draft.markov_head.markov_w2.weight.normal_(std=0.5)
        draft.confidence_head.proj.bias.fill_(1.0)
    draft.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    proposer = DSparkProposer(draft.eval(), confidence_threshold=threshold)
    report = evaluate(target, proposer, prompts, max_new_tokens=NEW, stop_ids=stop_token_ids(tok, "chatml"),
                      device=CPU)
    assert report.lossless == 2 and report.num_draft_tokens == 4
    assert 0 < report.summary()["proposed_per_round"] < 4.0  # the threshold cut some proposals short
