"""Reading HF tokenizer files into :class:`~titan_draft.data.tokenizer.hf.TokenizerFiles`.

A folder's ``tokenizer.json`` (vocabulary, merges, pre-tokenizer, normalizer, added tokens), its
``tokenizer_config.json`` (more added tokens, bos/eos/pad names, chat template) or a tiktoken ranks
file; ``hf_tokenizer_pretok`` turns the normalizer and pre-tokenizer into tiktoken's terms. Every
layout whose ids tiktoken could not reproduce is refused with a ValueError naming the file and
what is wrong; why the translation holds is in ``hf_tokenizer``'s module docstring.
"""

from __future__ import annotations

import dataclasses
import glob
import os

from titan_draft.components.json_file import read_json_object
from titan_draft.data.tokenizer.disk_cache import cached_tokenizer_json
from titan_draft.data.tokenizer.hf import (
    _TIKTOKEN_FAMILIES,
    TokenizerFiles,
    _check_specials_vs_ranks,
    _from_byte_level_table,
    bytes_to_unicode,
    check_ranks,
    check_unique_ids,
    load_tiktoken_ranks,
)
from titan_draft.data.tokenizer.hf_pretok import (
    SENTENCEPIECE_HINT,
    normalizer_name,
    pre_tokenizer_pattern,
)

__all__ = [
    "chat_template_path", "find_tokenizer_files", "hf_added_token_ids", "load_tokenizer_files"
]


def _added_token(path: str, where: str, entry: dict) -> tuple[str, bool]:
    content = entry.get("content")
    if not isinstance(content, str) or not content:
        raise ValueError(f"{path}: {where} has no content")
    for flag in ("lstrip", "rstrip", "single_word"):
        if entry.get(flag):
            # HF would eat whitespace around the token or match it only as a whole word; a plain
            # string match (tiktoken's, ours) cannot do that.
            raise ValueError(f"{path}: added token {content!r} has {flag}=true; not supported")
    return content, bool(entry.get("special", False))


def _merge_specials(path: str, specials: dict[str, int], content: str, token_id: object) -> None:
    if not isinstance(token_id, int) or token_id < 0:
        raise ValueError(f"{path}: added token {content!r} has id {token_id!r}")
    if specials.get(content, token_id) != token_id:
        raise ValueError(
            f"{path}: added token {content!r} has id {token_id} here but {specials[content]} "
            "elsewhere"
        )
    specials[content] = token_id


def hf_added_token_ids(vocab: dict[str, int], contents: list[str]) -> list[int]:
    """The ids HF ``tokenizers`` gives added tokens when it loads a tokenizer.json.

    The ids written in ``added_tokens`` are not read: a token whose content is a key of
    ``model.vocab`` gets that id, any other the next id after the vocabulary size and the added
    tokens before it (in file order), as ``AddedVocabulary::add_tokens`` numbers them.
    """
    size, top, given, ids = len(vocab), None, {}, []
    for content in contents:
        if content in vocab:
            token_id = vocab[content]
        elif content in given:  # listed twice: the first id
            token_id = given[content]
        elif top is None:
            token_id = size
        else:
            token_id = top + 1 if top >= size or size == 0 else size
        given.setdefault(content, token_id)
        ids.append(token_id)
        top = token_id if top is None else max(top, token_id)
    return ids


def _read_tokenizer_json(path: str) -> TokenizerFiles:
    data = read_json_object(path)
    model = data.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{path}: no 'model' section; not an HF tokenizer.json")
    if model.get("type") != "BPE":
        raise ValueError(
            f"{path}: model.type is {model.get('type')!r}; only byte-level BPE tokenizers "
            "(Qwen2/3, Llama-3, GPT-2 style) are supported"
        )
    if model.get("byte_fallback"):
        raise ValueError(f"{path}: model.byte_fallback is true: {SENTENCEPIECE_HINT}")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"{path}: model.{key} is {model[key]!r}; not supported")
    pat_str = pre_tokenizer_pattern(path, data.get("pre_tokenizer"))
    normalizer = normalizer_name(path, data.get("normalizer"))

    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{path}: model.vocab is missing or empty")
    check_unique_ids(f"{path}: model.vocab", vocab)

    added = data.get("added_tokens") or []
    entries = [_added_token(path, f"added_tokens[{i}]", entry) for i, entry in enumerate(added)]
    # An added token may also be a model.vocab key (BpeTrainer puts its special tokens there);
    # such an entry need not be byte-level.
    claimed = {content for content, _ in entries if content in vocab}
    alphabet = set(bytes_to_unicode().values())
    for s in vocab:
        if s not in claimed and not alphabet.issuperset(s):
            raise ValueError(
                f"{path}: model.vocab entry {s!r} is not written in the byte-level alphabet: "
                f"{SENTENCEPIECE_HINT}"
            )
    merged = _check_merges(path, vocab, model.get("merges") or [])

    table = _from_byte_level_table()
    ranks: dict[bytes, int] = {}
    for s, i in vocab.items():
        if s in claimed:
            # Also a BPE token if the BPE can build it (a byte or a merge result; the two must then
            # mean the same bytes, checked with the other clashes); else only ever the added token.
            if (len(s) == 1 or s in merged) and alphabet.issuperset(s):
                ranks[s.translate(table).encode("latin-1")] = i
            continue
        if len(s) > 1 and s not in merged:
            raise ValueError(
                f"{path}: model.vocab entry {s!r} (id {i}) is neither a byte nor the result of a "
                "merge: HF can only produce it as a whole word, tiktoken also from any two pieces "
                "that spell it, so the two would tokenize differently"
            )
        ranks[s.translate(table).encode("latin-1")] = i
    unk = model.get("unk_token")
    missing = check_ranks(path, ranks, allow_missing=True)  # HF skips them, unless unk below
    if missing and unk is not None:
        raise ValueError(
            f"{path}: no single-byte token for {len(missing)} of the 256 bytes (e.g. "
            f"{missing[:1]!r}) and model.unk_token is {unk!r}: HF encodes those bytes as the unk "
            "token, which is not supported (without an unk_token HF drops them, which is)"
        )

    specials: dict[str, int] = {}
    non_special: set[str] = set()
    hf_ids = hf_added_token_ids(vocab, [content for content, _ in entries])
    for entry, (content, special), hf_id in zip(added, entries, hf_ids):
        if entry.get("id") != hf_id:
            raise ValueError(
                f"{path}: added token {content!r} is written with id {entry.get('id')!r}, but HF "
                f"tokenizers gives it id {hf_id} on loading (an added token that is not in "
                "model.vocab gets the next id after the vocabulary, in file order)"
            )
        _merge_specials(path, specials, content, hf_id)
        if not special:
            non_special.add(content)
    return TokenizerFiles(
        source=path,
        ranks=ranks,
        special_tokens=specials,
        non_special_tokens=frozenset(non_special),
        pat_str=pat_str,
        normalizer=normalizer,
        missing_bytes=missing,
    )


def _check_merges(path: str, vocab: dict[str, int], merges: list) -> set[str]:
    """Checks that merge order is id order; returns the set of merge results."""
    results: set[str] = set()
    prev_id, prev_index = -1, -1
    for i, merge in enumerate(merges):
        # Both formats exist: "a b" (older files, Qwen) and ["a", "b"] (tokenizers >= 0.20). A
        # byte-level token never contains a space (0x20 is written "Ġ"), so the split is safe.
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(pair, list) or [type(x) for x in pair] != [str, str]:
            raise ValueError(f"{path}: model.merges[{i}] is {merge!r}, neither 'a b' nor [a, b]")
        a, b = pair
        for token in (a, b, a + b):
            if token not in vocab:
                raise ValueError(
                    f"{path}: model.merges[{i}] ({a!r}, {b!r}): {token!r} is not in model.vocab"
                )
        result_id = vocab[a + b]
        if result_id < prev_id:
            # Several merges may make the same token (Llama-3 lists every split), hence "<".
            raise ValueError(
                f"{path}: merges are not in id order: model.merges[{i}] makes {a + b!r} (id "
                f"{result_id}) after model.merges[{prev_index}] made id {prev_id}. tiktoken "
                "applies the merge whose result has the lowest id first, HF the one listed first; "
                "they agree only when both orders are the same"
            )
        prev_id, prev_index = result_id, i
        results.add(a + b)
    return results


def _config_chat_template(path: str, value: object) -> str | None:
    # transformers writes one template as a string and several as [{"name", "template"}], of
    # which it applies "default" unless asked for another by name.
    if value is None or isinstance(value, str):
        return value
    entries = value if isinstance(value, list) else None
    if entries is not None and all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str)
        for e in entries
    ):
        return {e["name"]: e["template"] for e in entries}.get("default")
    raise ValueError(
        f"{path}: chat_template is neither a string nor a list of {{'name': ..., 'template': ...}}"
    )


def chat_template_path(bpe_path: str) -> str | None:
    """The ``chat_template.jinja`` beside ``bpe_path`` if there is one. transformers >= 4.47 saves
    the template there instead of in tokenizer_config.json and prefers it when loading."""
    path = os.path.join(os.path.dirname(bpe_path), "chat_template.jinja")
    return path if os.path.isfile(path) else None


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8: {e}") from None


def _read_tokenizer_config(path: str, specials: dict[str, int], non_special: set[str]) -> dict:
    """Adds tokenizer_config.json's added tokens to ``specials``; returns its bos/eos/pad names
    and chat template as TokenizerFiles fields."""
    cfg = read_json_object(path)
    decoder = cfg.get("added_tokens_decoder") or {}
    for key, entry in decoder.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{path}: added_tokens_decoder key {key!r} is not an id") from None
        content, special = _added_token(path, f"added_tokens_decoder[{key}]", entry)
        _merge_specials(path, specials, content, token_id)
        if not special:
            non_special.add(content)
    names = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = cfg.get(key)
        if isinstance(value, dict):  # older files write an AddedToken object
            value = value.get("content")
        if value is not None and value not in specials:
            raise ValueError(f"{path}: {key} {value!r} is not one of the added tokens")
        names[key] = value
    names["chat_template"] = _config_chat_template(path, cfg.get("chat_template"))
    return names


def find_tokenizer_files(path: str) -> tuple[str, str | None]:
    """``(bpe_file, tokenizer_config_or_None)`` for an HF folder, a tokenizer.json or a ranks file.

    A folder uses its ``tokenizer.json`` if present, else its one ``*.tiktoken`` or
    ``tokenizer.model`` ranks file; ``tokenizer_config.json`` is looked for beside the file.
    """
    if os.path.isdir(path):
        bpe_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(bpe_path):
            found = sorted(glob.glob(os.path.join(path, "*.tiktoken")))
            if os.path.isfile(os.path.join(path, "tokenizer.model")):
                found.append(os.path.join(path, "tokenizer.model"))
            if not found:
                raise ValueError(f"{path}: no tokenizer.json, *.tiktoken or tokenizer.model here")
            if len(found) > 1:
                raise ValueError(f"{path}: several ranks files ({', '.join(found)}); pass one")
            bpe_path = found[0]
    elif os.path.isfile(path):
        bpe_path = path
    else:
        raise ValueError(f"{path}: no such tokenizer file or folder")
    cfg_path = os.path.join(os.path.dirname(bpe_path), "tokenizer_config.json")
    return bpe_path, cfg_path if os.path.isfile(cfg_path) else None


def load_tokenizer_files(path: str) -> TokenizerFiles:
    """Read a tokenizer from an HF folder, a ``tokenizer.json`` or a tiktoken ranks file.

    Files are found as ``find_tokenizer_files`` says. ``tokenizer_config.json`` adds its added
    tokens, the bos/eos/pad names and the chat template (a ``chat_template.jinja`` beside it wins,
    as in transformers); a ranks file needs it (special tokens live only there) and must be of a
    family whose regex we know (Qwen2/2.5/3 or Llama-3.x, told apart by rank count). Raises
    ValueError naming the file and the problem.
    """
    bpe_path, cfg_path = find_tokenizer_files(path)
    if bpe_path.endswith(".json"):
        files = cached_tokenizer_json(bpe_path, _read_tokenizer_json)
    else:
        ranks = load_tiktoken_ranks(bpe_path)
        check_ranks(bpe_path, ranks)
        family = _TIKTOKEN_FAMILIES.get(len(ranks))
        if family is None:
            known = ", ".join(f"{name}: {n}" for n, (name, _, _) in _TIKTOKEN_FAMILIES.items())
            raise ValueError(
                f"{bpe_path}: {len(ranks)} ranks match no known family ({known}); a ranks file "
                "has no pre-tokenizer regex, so pass the folder's tokenizer.json instead"
            )
        if cfg_path is None:
            raise ValueError(
                f"{bpe_path}: a ranks file has no special tokens; they come from the "
                "tokenizer_config.json (added_tokens_decoder) beside it, which is missing"
            )
        _, pat_str, normalizer = family
        files = TokenizerFiles(bpe_path, ranks, {}, frozenset(), pat_str, normalizer)
    non_special = set(files.non_special_tokens)
    names = _read_tokenizer_config(cfg_path, files.special_tokens, non_special) if cfg_path else {}
    jinja = chat_template_path(bpe_path)
    if jinja is not None:
        names["chat_template"] = _read_text(jinja)
    _check_specials_vs_ranks(files.source, files.ranks, files.special_tokens)
    return dataclasses.replace(files, non_special_tokens=frozenset(non_special), **names)
