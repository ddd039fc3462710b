"""Conversations as the target sees them: chat formats and loss masks, the system prompt, eval prompts."""
