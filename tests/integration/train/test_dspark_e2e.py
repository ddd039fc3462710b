"""DSpark through the real, unchanged trainer on CPU: exact kill-and-resume, the export and the
true-τ eval CLI on it (at two confidence thresholds). Two gloo ranks with float8 + compile + FSDP2:
tests/integration/distributed/test_two_rank_float8.py."""

from __future__ import annotations

import json
from functools import partial

from titan_draft.checkpoint.export import load_export
from titan_draft.eval import main as eval_main
from helpers import check_exact_resume, debug_job_argv

BAD_FRAGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp", "embed", "target_lm_head")
_args = partial(debug_job_argv, "dspark")  # (dump, target, data, *extra)


def test_trains_resumes_exports_and_decodes(tmp_path, random_target_dir, chat_jsonl):
    common = ("--training.steps", "6", "--checkpoint.interval", "3")
    full = check_exact_resume(lambda dump: _args(dump, random_target_dir, chat_jsonl, *common), tmp_path)
    assert full[6] < full[1]  # it learns something in six steps

    tensors, config = load_export(str(tmp_path / "full" / "export"))
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 4
    assert config["dflash_config"]["markov_rank"] == config["markov_rank"]
    assert config["markov_head_type"] == "vanilla" and config["enable_confidence_head"] is True
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
    assert "markov_head.markov_w2.weight" in tensors and "confidence_head.proj.weight" in tensors
    taus = {}
    for thr in ("0", "0.9"):
        out = tmp_path / f"tau-{thr}.json"
        eval_main(["--target", random_target_dir, "--draft", str(tmp_path / "full" / "export"), "--prompts",
                   "mtbench", "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(out),
                   "--proposer-option", f"confidence_threshold={thr}"])
        got = json.loads(out.read_text())
        assert got["summary"]["lossless_prompts"] == 2 and got["summary"]["num_draft_tokens"] == 4
        assert got["proposer_options"] == {"confidence_threshold": float(thr)}
        taus[thr] = got
    # a high threshold proposes fewer tokens per round than none
    proposed = {thr: sum(sum(p["proposed"]) for p in r["prompts"]) for thr, r in taus.items()}
    assert proposed["0.9"] < proposed["0"], proposed
