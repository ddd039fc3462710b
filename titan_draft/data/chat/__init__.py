"""Conversations as the target sees them: chat formats and loss masks (``template.py``), the system
prompt (``system_prompt.py``), the run's resolved format (``format.py``) and eval prompts (``prompts.py``)."""

from titan_draft.data.chat.format import ChatFormat, build_chat_format, resolve_chat_format
from titan_draft.data.chat.template import Turn, render_chat

__all__ = ["ChatFormat", "Turn", "build_chat_format", "render_chat", "resolve_chat_format"]
