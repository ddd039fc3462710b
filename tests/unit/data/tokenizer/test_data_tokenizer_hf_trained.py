"""BPEs trained here by HF `tokenizers` (GPT-2 and Llama-3 layouts): tokenizer.json -> ours gives
HF's ids, and ours -> tokenizer.json reads back into HF with the same ids."""

from __future__ import annotations

import copy
import json
import os

import pytest

from test_data_tokenizer_hf import CORPUS, _same_encoding, assert_parity, write_json
from titan_draft.data.tokenizer.hf import GPT2_PAT, LLAMA3_PAT, QWEN_PAT
from titan_draft.data.tokenizer.hf_save import derive_merges, save_hf_tokenizer
from titan_draft.data.tokenizer import build_tokenizer

# ---------------------------------------------------------------------------------------------
# BPEs trained by HF tokenizers: tokenizer.json -> ours, and ours -> tokenizer.json.

TRAIN_TEXT = CORPUS * 3 + [
    "In the beginning was the word, and the word was tokenized into many many pieces.",
    "Speculative decoding drafts tokens with a small model and verifies them with the target.",
    "自然语言处理和大语言模型正在改变世界。東京タワーと富士山。",
    "for i in range(10):\n    print(i, i * i)  # squares\n",
]


def _train(tmp_path, name, layout):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    if layout == "gpt2":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        specials = ["<|endoftext|>"]
    else:  # Llama-3 layout, plus NFC and a BOS post-processor that encode() must not apply
        tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        specials = ["<|begin_of_text|>", "<|endoftext|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=specials,  # these land in model.vocab too, at ids 0..
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|reserved_special_token_0|>"])
    tok.add_tokens(["<think>"])  # an added token that is not special
    if layout == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        )
    path = str(tmp_path / name)
    os.makedirs(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    return tok, path


@pytest.mark.parametrize("layout", ["gpt2", "llama3"])
def test_trained_bpe_parity(tmp_path, layout):
    hf, folder = _train(tmp_path, layout, layout)
    ours = build_tokenizer(folder)
    assert ours.encoding._pat_str == (GPT2_PAT if layout == "gpt2" else LLAMA3_PAT)
    assert ours.normalizer == (None if layout == "gpt2" else "NFC")
    assert ours.special_tokens["<|endoftext|>"] == hf.token_to_id("<|endoftext|>")
    assert ours.non_special_tokens == {"<think>"}
    assert_parity(ours, hf, CORPUS + ["x <think> y", "<|reserved_special_token_0|><|endoftext|>"])
    if layout == "llama3":
        bos = hf.token_to_id("<|begin_of_text|>")
        assert hf.encode("hi").ids == [bos, *ours.encode("hi")]  # HF's post-processor adds BOS
        assert ours.unused_token_id(ours.n_vocab) == ours.token_id("<|reserved_special_token_0|>")

    tokenizers = pytest.importorskip("tokenizers")
    # Merges written as "a b" strings (older files) load to the same encoding.
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    assert isinstance(data["model"]["merges"][0], list)
    strings = copy.deepcopy(data)
    strings["model"]["merges"] = [" ".join(m) for m in data["model"]["merges"]]
    again = build_tokenizer(write_json(tmp_path / "strings", strings))
    assert again.encoding._mergeable_ranks == ours.encoding._mergeable_ranks

    if layout == "llama3":
        # Llama-3's own file lists a merge for every split of a token into two tokens (several
        # merges per result, ordered by result id): same encoding, and HF still agrees.
        splits = []
        for token, tid in data["model"]["vocab"].items():
            for i in range(1, len(token)):
                left, right = token[:i], token[i:]
                if left in data["model"]["vocab"] and right in data["model"]["vocab"]:
                    ids = (tid, data["model"]["vocab"][left], data["model"]["vocab"][right])
                    splits.append((ids, [left, right]))
        every = copy.deepcopy(data)
        every["model"]["merges"] = [pair for _, pair in sorted(splits)]
        assert len(every["model"]["merges"]) > len(data["model"]["merges"])
        path = write_json(tmp_path / "every_split", every)
        assert build_tokenizer(path).encoding._mergeable_ranks == ours.encoding._mergeable_ranks
        assert_parity(ours, tokenizers.Tokenizer.from_file(path))

    # And back: our encoding written as an HF folder tokenizes the same in HF tokenizers.
    out = str(tmp_path / "written")
    save_hf_tokenizer(ours, out)
    _same_encoding(build_tokenizer(out), ours)
    assert_parity(ours, tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json")))


def test_merge_order_error_on_real_merges(tmp_path):
    # Reordering two merges of a trained BPE breaks "merge order == id order".
    _, folder = _train(tmp_path, "t", "gpt2")
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    merges = data["model"]["merges"]
    merges[10], merges[20] = merges[20], merges[10]
    with pytest.raises(ValueError, match=r"not in id order: model.merges\[11\]"):
        build_tokenizer(write_json(tmp_path / "swapped", data))


def test_derive_merges_refuses_unreachable_token():
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"abc"] = 256  # neither "ab" nor "bc" exists: no merge can make it
    enc = tiktoken.Encoding("t", pat_str=QWEN_PAT, mergeable_ranks=ranks, special_tokens={})
    with pytest.raises(ValueError, match="cannot be built by merging"):
        derive_merges(enc)
