"""A run's chat format, resolved once and handed to everything that renders a conversation.

``data.chat_template = "auto"`` is read off the target's tokenizer and ``data.system_prompt =
"auto"`` off its Jinja template (system_prompt.py); both resolutions are decisions about the
target, so a run makes them once (the trainer, prepare_features, the eval CLI) and passes the
result on: the data pipeline, the held-out validation rows, the eval prompts, the feature cache's
manifest, the resume guard, run_info.json and the drafts' args hooks all see the same values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from titan_draft.data.chat.system_prompt import resolve_system_prompt
from titan_draft.data.chat.template import check_template, resolve_template, template_special_tokens
from titan_draft.data.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatFormat", "build_chat_format", "resolve_chat_format"]


@dataclass(frozen=True)
class ChatFormat:
    """How a run renders conversations (every field resolved, none of them 'auto')."""

    template: str
    """The format: 'chatml', 'qwen3' or 'llama3'."""
    system_prompt: str
    """The system turn a conversation without one gets ('' for none)."""
    enable_thinking: bool = True
    """Qwen3's thinking mode (``data.enable_thinking``)."""
    last_turn_only: bool = False
    """Train on each conversation's last assistant turn only (``data.last_turn_only``)."""
    template_tokens: tuple[str, ...] = ()
    """'jinja': the tokenizer's special tokens that the folder's template spells out."""

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The special tokens the format writes (none of them can be a draft's mask token)."""
        return template_special_tokens(self.template) + self.template_tokens

    def describe(self) -> str:
        """The format as the data log line names it."""
        text = self.template
        if self.template == "qwen3":
            text += f" (enable_thinking={self.enable_thinking})"
        if self.last_turn_only:
            text += ", last assistant turn only"
        return text


# The start-up check (components/preflight.py) and the trainer ask for the same format of the same
# cached tokenizer: the Jinja template is rendered once.
@functools.lru_cache(maxsize=8)
def resolve_chat_format(tokenizer: Tokenizer, *, template: str, system_prompt: str, enable_thinking: bool = True,
                        last_turn_only: bool = False, key: str = "data.chat_template") -> ChatFormat:
    """The format ``template`` (or 'auto': the tokenizer's family) with ``system_prompt`` (or
    'auto': the one the target's own template adds); a ValueError naming ``key`` for a format
    the tokenizer cannot write."""
    try:
        resolved = resolve_template(template, tokenizer)
        check_template(resolved, tokenizer)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    # a folder's template writes its family's own tokens: keep them out of a draft's reach
    written = tuple(sorted(t for t in tokenizer.encoding.special_tokens_set if t in tokenizer.chat_template)) \
        if resolved == "jinja" else ()
    return ChatFormat(template=resolved, system_prompt=resolve_system_prompt(system_prompt, tokenizer, resolved),
                      enable_thinking=enable_thinking, last_turn_only=last_turn_only, template_tokens=written)


def build_chat_format(data_cfg: Any, tokenizer: Tokenizer) -> ChatFormat:
    """The format of a job's ``[data]`` section for the target's tokenizer."""
    return resolve_chat_format(tokenizer, template=data_cfg.chat_template, system_prompt=data_cfg.system_prompt,
                               enable_thinking=data_cfg.enable_thinking, last_turn_only=data_cfg.last_turn_only)
