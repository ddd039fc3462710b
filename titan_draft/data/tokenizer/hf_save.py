"""Write a tiktoken-based ``Tokenizer`` as an HF tokenizer folder (the reverse of ``hf_tokenizer``).

Used to give a random-weight HF checkpoint a tokenizer that transformers / SGLang load as the real
target's. HF's BPE follows a merge list where tiktoken follows ranks, so the merges are derived
from the ranks: for each token, the two pieces tiktoken's own BPE joins into it.
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING

import tiktoken

from titan_draft.data.tokenizer.hf import QWEN_PAT, to_byte_level
from titan_draft.data.tokenizer.hf_files import hf_added_token_ids

if TYPE_CHECKING:
    from titan_draft.data.tokenizer.tokenizer import Tokenizer

__all__ = ["derive_merges", "save_hf_tokenizer"]


def _split(token: bytes, rank: int, get) -> list[bytes]:
    # tiktoken's BPE on the token's own bytes, allowed only ranks below its own: the leftmost
    # lowest-rank pair merges first, as in tiktoken. Ends at the two pieces tiktoken joins into it.
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1], rank)
            if r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


@functools.lru_cache(maxsize=4)
def derive_merges(encoding: tiktoken.Encoding) -> tuple[tuple[bytes, bytes], ...]:
    """HF merge list that reproduces ``encoding``'s BPE: one merge per multi-byte token, in rank
    order, joining the two pieces tiktoken itself reaches on that token's bytes.

    Cached per encoding (about a second for Qwen's 151k ranks). Raises ValueError for a token that
    lower ranks cannot build (no single merge would make HF agree with tiktoken on it).
    """
    ranks = encoding._mergeable_ranks  # tiktoken keeps no public accessor for the ranks
    get = ranks.get
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _split(token, rank, get)
        if len(parts) != 2:
            raise ValueError(
                f"tokenizer {encoding.name!r}: token {token!r} (rank {rank}) cannot be built by "
                "merging lower-rank tokens; it has no HF merge equivalent"
            )
        merges.append((parts[0], parts[1]))
    return tuple(merges)


def save_hf_tokenizer(
    tokenizer: Tokenizer,
    folder: str,
    *,
    model_max_length: int = 131072,
    chat_template: str | None = None,
) -> None:
    """Write ``tokenizer`` as an HF tokenizer: ``tokenizer.json`` and ``tokenizer_config.json``.

    The BPE gets the byte-level vocabulary and the merges of ``derive_merges``; the pre-tokenizer is
    Split(regex) + ByteLevel(use_regex=false), the normalizer NFC if the tokenizer has one, every
    special token an added token (``special`` false for ``tokenizer.non_special_tokens``). No
    post-processor adds BOS/EOS: chat templates write them. ``build_tokenizer(folder)`` gives back
    the same encoding, and HF ``tokenizers`` gives the same ids (tested); a BPE without some
    single-byte tokens is written without an unk_token, so HF drops those bytes as we do.
    ``chat_template`` (None: the tokenizer's own, ``tokenizer.chat_template``, if it has one) goes
    into tokenizer_config.json, where transformers and SGLang read it.
    """
    encoding = tokenizer.encoding
    merges = derive_merges(encoding)
    spelled = {token: to_byte_level(token) for token in encoding._mergeable_ranks}
    vocab = {spelled[token]: rank for token, rank in encoding._mergeable_ranks.items()}
    ordered = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    # HF ignores the ids written for added tokens: one that is a model.vocab key gets that id, the
    # others are numbered on after the vocabulary. Put into model.vocab, as BpeTrainer does, each
    # one that this count would misnumber (none for Qwen or Llama-3, whose specials follow the BPE).
    while True:
        got = hf_added_token_ids(vocab, [content for content, _ in ordered])
        wrong = next(((c, t) for (c, t), g in zip(ordered, got) if g != t), None)
        if wrong is None:
            break
        if wrong[0] in vocab:
            raise ValueError(
                f"tokenizer {tokenizer.name!r}: added token {wrong[0]!r} (id {wrong[1]}) is "
                f"spelled like BPE token id {vocab[wrong[0]]}, which HF would give it instead"
            )
        vocab[wrong[0]] = wrong[1]
    byte_level = {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False
    }
    added = [
        {
            "id": tid,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": content not in tokenizer.non_special_tokens,
        }
        for content, tid in ordered
    ]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if tokenizer.normalizer == "NFC" else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": encoding._pat_str},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            # As Qwen's own file; derive_merges makes every token reachable by merges anyway.
            "ignore_merges": False,
            "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
            "merges": [f"{spelled[a]} {spelled[b]}" for a, b in merges],
        },
    }
    named = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(entry["id"]): {k: v for k, v in entry.items() if k != "id"} for entry in added
        },
        "additional_special_tokens": [
            e["content"] for e in added if e["special"] and e["content"] not in named
        ],
        "bos_token": tokenizer.bos_token,
        "clean_up_tokenization_spaces": False,
        "eos_token": tokenizer.eos_token,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": tokenizer.pad_token,
        "split_special_tokens": False,
        # transformers rebuilds Qwen2Tokenizer from vocab + merges with this same regex and NFC.
        "tokenizer_class": "Qwen2Tokenizer"
        if encoding._pat_str == QWEN_PAT and tokenizer.normalizer == "NFC"
        else "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    if chat_template is None:
        chat_template = tokenizer.chat_template
    if chat_template is not None:
        config["chat_template"] = chat_template
    os.makedirs(folder, exist_ok=True)
    # json.dumps without indent runs entirely in json's C encoder (json.dump to a file does not).
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(tokenizer_json, ensure_ascii=False))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
