"""HF tokenizer files -> tiktoken, for byte-level BPE tokenizers (Qwen2/2.5/3, Llama-3.x, GPT-2).

Users arrive with an HF folder (``tokenizer.json``, ``tokenizer_config.json``, maybe a ``.tiktoken``
ranks file); training must produce the ids the HF tokenizer gives, using only tiktoken at run time.

Why the translation holds: a byte-level BPE is a table of byte strings with ids, a pre-tokenizer
regex and a merge order. tiktoken uses the id as the rank and, inside each regex piece, merges the
adjacent pair whose concatenation has the lowest rank; HF merges the pair listed first in
``merges``. They agree when merge order is id order and every token is built by the merges, which
holds for BPE trained by ``tokenizers`` and for files converted from tiktoken ranks (Qwen,
Llama-3); both are checked here, along with everything tiktoken would silently do differently (a
missing byte, an id given to two tokens, a regex that drops text). What no cheap check proves
(tiktoken also merges a pair that spells a token when no merge lists that pair) is covered by the
parity tests against HF ``tokenizers``.

``ignore_merges``: tiktoken always looks a whole regex piece up in its ranks before merging, which
is HF's ``ignore_merges=true`` (Llama-3 sets it to match tiktoken). With ``false`` (Qwen, trained
BPE) HF's merges rebuild a vocabulary word from its bytes anyway for these BPEs, so the flag is
read as a no-op (tested on Qwen's tokens).

Added tokens: HF numbers them itself when it loads a file (``hf_added_token_ids``) and matches
them in the raw text before the normalizer and BPE run; all of them, special or not, become
tiktoken special tokens. Post-processors (Llama-3's BOS) are ignored: chat templates write BOS.
Known gap: an added token marked ``normalized: true`` is matched in the raw text here, in the
normalized text by HF; they differ only if NFC changes the characters around it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import glob
import json
import os

import tiktoken

__all__ = [
    "GPT2_PAT",
    "LLAMA3_PAT",
    "QWEN_PAT",
    "TokenizerFiles",
    "build_encoding",
    "bytes_to_unicode",
    "find_tokenizer_files",
    "hf_added_token_ids",
    "load_tiktoken_ranks",
    "load_tokenizer_files",
    "to_byte_level",
]

# The regex HF's ByteLevel pre-tokenizer applies with use_regex=true (GPT-2's).
GPT2_PAT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama-3.x: numbers in groups of up to three digits.
LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/Qwen2.5/Qwen3: one digit per token (`\p{N}` alone); otherwise Llama-3's.
QWEN_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A .tiktoken file is ranks only: no regex, no normalizer. We recognize the families we know by
# their rank count rather than guess (tokenizer.json carries the regex and is preferred).
_TIKTOKEN_FAMILIES = {
    151643: ("Qwen2/2.5/3", QWEN_PAT, "NFC"),
    128000: ("Llama-3.x", LLAMA3_PAT, None),
}

# Text a pre-tokenizer regex must reproduce byte for byte: tiktoken drops what the regex does not
# match, where HF keeps it as its own piece.
_PROBE = (
    "Hello, World! It's 2024-05-01; x_1 = 3.14e-2.\n\n\tdef f(a):\r\n        return a  # ok\n"
    "日本語のテキスト。Привет, мир! مرحبا بالعالم café naïve 👍🏽👨\u200d👩\u200d👧 🇫🇷 \u00a0\u3000 "
    "   \n\n\n  "
)


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, 0x7f-0xa0,
    0xad) are given the characters U+0100, U+0101, ... in byte order, so every token is printable.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(0x100 + n) for n, b in enumerate(others)})
    return table


@functools.lru_cache(maxsize=None)
def _from_byte_level_table() -> dict[int, int]:
    # str.translate table: byte-level character -> Latin-1 character of its byte, so that
    # ``s.translate(table).encode("latin-1")`` gives the token's bytes in one C call.
    return {ord(c): b for b, c in bytes_to_unicode().items()}


def to_byte_level(data: bytes) -> str:
    """``data`` written in the byte-level alphabet, as tokenizer.json vocabularies spell tokens."""
    # Latin-1 maps each byte to the character of the same number; translate renames those.
    return data.decode("latin-1").translate(bytes_to_unicode())


@dataclasses.dataclass
class TokenizerFiles:
    """What a tokenizer file or folder describes, in tiktoken's terms.

    Attributes:
        source: the file the BPE came from (tokenizer.json or a ranks file), for messages.
        ranks: token bytes -> id of every BPE token (tiktoken's ``mergeable_ranks``).
        special_tokens: every HF added token, special or not -> id (matched in text before BPE).
        non_special_tokens: added tokens HF marks ``special: false`` (e.g. Qwen3's ``<think>``).
        pat_str: the pre-tokenizer regex.
        normalizer: ``"NFC"`` or None.
        bos_token, eos_token, pad_token: as tokenizer_config.json names them (None if absent).
    """

    source: str
    ranks: dict[bytes, int]
    special_tokens: dict[str, int]
    non_special_tokens: frozenset[str]
    pat_str: str
    normalizer: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Ranks of a tiktoken file: one ``<base64 token> <rank>`` per line (Qwen's ``qwen.tiktoken``,
    Llama-3's ``original/tokenizer.model``)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise ValueError(
                f"{path}: line {lineno} is not '<base64 token> <rank>', so this is not a "
                "tiktoken ranks file (a SentencePiece tokenizer.model, as Llama-2 ships, is not a "
                "byte-level BPE and is not supported)"
            ) from None
        if token in ranks:
            raise ValueError(f"{path}: line {lineno}: token {token!r} is listed twice")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path}: empty tiktoken ranks file")
    return ranks


def _check_ranks(source: str, ranks: dict[bytes, int]) -> None:
    # tiktoken panics (not a Python error) on duplicate ids, and on text with a byte it has no
    # token for; HF would drop such a byte silently. Both are refused here instead.
    seen: dict[int, bytes] = {}
    for token, rank in ranks.items():
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"{source}: token {token!r} has id {rank!r}; ids must be ints >= 0")
        if rank in seen:
            raise ValueError(f"{source}: id {rank} is both {seen[rank]!r} and {token!r}")
        seen[rank] = token
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"{source}: no single-byte token for {len(missing)} of the 256 bytes (e.g. "
            f"{bytes([missing[0]])!r}); a byte-level BPE needs all of them to encode any text"
        )


def _describe(component: dict | None) -> str:
    if component is None:
        return "null"
    kind = component.get("type")
    inner = component.get("pretokenizers") or component.get("normalizers")
    if kind == "Sequence" and isinstance(inner, list):
        return "Sequence[" + ", ".join(_describe(c) for c in inner) + "]"
    return str(kind)


_SENTENCEPIECE_HINT = (
    "not a byte-level BPE (this looks like a SentencePiece-style tokenizer, e.g. Llama-2 or "
    "Mistral); only byte-level BPE tokenizers (Qwen2/3, Llama-3, GPT-2 style) are supported"
)


def _check_byte_level_step(path: str, step: dict, where: str) -> None:
    if step.get("add_prefix_space"):
        raise ValueError(
            f"{path}: {where}.add_prefix_space is true (HF then prepends a space to every text "
            "segment); not supported"
        )


def _pre_tokenizer_pattern(path: str, pre: dict | None) -> str:
    """The single regex that splits text into BPE pieces, from the supported layouts."""
    kinds = _describe(pre)
    if pre is None or "Metaspace" in kinds:
        raise ValueError(f"{path}: pre_tokenizer is {kinds}: {_SENTENCEPIECE_HINT}")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        _check_byte_level_step(path, pre, "pre_tokenizer")
        return GPT2_PAT
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and kinds == "Sequence[Split, ByteLevel]":
        split, byte_level = steps
        _check_byte_level_step(path, byte_level, "pre_tokenizer.pretokenizers[1]")
        pattern = split.get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if (
            isinstance(regex, str)
            and split.get("behavior") == "Isolated"
            and not split.get("invert", False)
            and not byte_level.get("use_regex", True)
        ):
            return regex
        raise ValueError(
            f"{path}: pre_tokenizer Sequence[Split, ByteLevel] must be Split(pattern={{'Regex': "
            "...}, behavior='Isolated', invert=false) then ByteLevel(use_regex=false); got "
            f"Split(pattern={pattern!r}, behavior={split.get('behavior')!r}, "
            f"invert={split.get('invert')!r}), "
            f"ByteLevel(use_regex={byte_level.get('use_regex', True)!r})"
        )
    raise ValueError(
        f"{path}: unsupported pre_tokenizer {kinds}; supported: ByteLevel(use_regex=true) or "
        "Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]"
    )


def _normalizer(path: str, norm: dict | None) -> str | None:
    if norm is None:
        return None
    kinds = [norm.get("type")]
    if kinds == ["Sequence"]:
        kinds = [n.get("type") for n in norm.get("normalizers") or []]
    if not kinds:
        return None
    if kinds == ["NFC"]:
        return "NFC"
    raise ValueError(f"{path}: unsupported normalizer {_describe(norm)}; supported: null or NFC")


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
    data = _read_json(path)
    model = data.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{path}: no 'model' section; not an HF tokenizer.json")
    if model.get("type") != "BPE":
        raise ValueError(
            f"{path}: model.type is {model.get('type')!r}; only byte-level BPE tokenizers "
            "(Qwen2/3, Llama-3, GPT-2 style) are supported"
        )
    if model.get("byte_fallback"):
        raise ValueError(f"{path}: model.byte_fallback is true: {_SENTENCEPIECE_HINT}")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"{path}: model.{key} is {model[key]!r}; not supported")
    pat_str = _pre_tokenizer_pattern(path, data.get("pre_tokenizer"))
    normalizer = _normalizer(path, data.get("normalizer"))

    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{path}: model.vocab is missing or empty")
    id_to_str: dict[int, str] = {}
    for s, i in vocab.items():
        if not isinstance(i, int) or i < 0:
            raise ValueError(f"{path}: model.vocab[{s!r}] is {i!r}; ids must be integers >= 0")
        if i in id_to_str:
            raise ValueError(f"{path}: model.vocab gives id {i} to both {id_to_str[i]!r} and {s!r}")
        id_to_str[i] = s

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
                f"{_SENTENCEPIECE_HINT}"
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
    _check_ranks(path, ranks)

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


def _read_tokenizer_config(path: str, specials: dict[str, int], non_special: set[str]) -> dict:
    """Adds tokenizer_config.json's added tokens to ``specials``; returns its bos/eos/pad names."""
    cfg = _read_json(path)
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
    return names


def _check_specials_vs_ranks(
    source: str, ranks: dict[bytes, int], specials: dict[str, int]
) -> None:
    by_id = {rank: token for token, rank in ranks.items()}
    owners: dict[int, str] = {}
    for content, tid in specials.items():
        if tid in owners:
            raise ValueError(f"{source}: added tokens {owners[tid]!r} and {content!r} share {tid}")
        owners[tid] = content
        token = by_id.get(tid)
        if token is not None and token != content.encode("utf-8"):
            raise ValueError(
                f"{source}: added token {content!r} has id {tid}, which is the BPE token {token!r}"
            )


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
    tokens and the bos/eos/pad names; a ranks file needs it (special tokens live only there) and
    must be of a family whose regex we know (Qwen2/2.5/3 or Llama-3.x, told apart by rank count).
    Raises ValueError naming the file and the problem.
    """
    bpe_path, cfg_path = find_tokenizer_files(path)
    if bpe_path.endswith(".json"):
        files = _read_tokenizer_json(bpe_path)
    else:
        ranks = load_tiktoken_ranks(bpe_path)
        _check_ranks(bpe_path, ranks)
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
    _check_specials_vs_ranks(files.source, files.ranks, files.special_tokens)
    return dataclasses.replace(files, non_special_tokens=frozenset(non_special), **names)


def build_encoding(files: TokenizerFiles, name: str) -> tiktoken.Encoding:
    """The tiktoken ``Encoding`` of ``files``; fails if the regex does not compile or drops text."""
    try:
        encoding = tiktoken.Encoding(
            name=name,
            pat_str=files.pat_str,
            mergeable_ranks=files.ranks,
            special_tokens=files.special_tokens,
        )
    except ValueError as e:
        raise ValueError(
            f"{files.source}: pre-tokenizer regex {files.pat_str!r} does not compile for "
            f"tiktoken: {e}"
        ) from None
    if encoding.decode_bytes(encoding.encode_ordinary(_PROBE)) != _PROBE.encode("utf-8"):
        raise ValueError(
            f"{files.source}: pre-tokenizer regex {files.pat_str!r} does not match all text "
            "(tiktoken drops what it does not match, HF keeps it), so the two would differ"
        )
    return encoding
