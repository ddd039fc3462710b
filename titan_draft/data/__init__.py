"""Data: tokenizer (tiktoken), chat templates + loss masks, row sources, torchdata pipeline."""

from titan_draft.data.chat.template import Turn, render_chat
from titan_draft.data.pipeline import ChatDataLoader, build_dataloader
from titan_draft.data.sources.rows import SKIP_REASONS, load_rows, normalize_row
from titan_draft.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "SKIP_REASONS",
    "ChatDataLoader",
    "Tokenizer",
    "Turn",
    "build_dataloader",
    "build_tokenizer",
    "load_rows",
    "normalize_row",
    "render_chat",
]
