"""The simulator's tokenizer: a stand-in that counts tokens the way BPE tokenizers roughly do.

Words and punctuation are pieces; a piece costs one token per four characters begun. A chat
request adds a few tokens per message for its template, as chat templates do. The gateway never
sees this rule: it learns its characters-per-token ratio from the `usage` the simulator returns,
as it must from a real engine's.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

_PIECES = re.compile(r"\w+|[^\w\s]")
_TEMPLATE_TOKENS_PER_MESSAGE = 4
_TEMPLATE_TOKENS_PER_REPLY = 3


def count_tokens(text: str) -> int:
    return sum((len(piece) + 3) // 4 for piece in _PIECES.findall(text))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones count here
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def prompt_text(request: dict[str, Any], *, chat: bool) -> str:
    """The prompt's text (what natural output lengths are drawn from)."""
    if chat:
        messages = request.get("messages")
        if not isinstance(messages, list):
            return ""
        return "\n".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = request.get("prompt", "")
    if isinstance(prompt, list):
        return " ".join(p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt)
    return str(prompt)


def prompt_tokens(request: dict[str, Any], *, chat: bool) -> int:
    """The prompt's length in tokens, as an engine would report it in `usage.prompt_tokens`."""
    if chat:
        messages = request.get("messages")
        count = len(messages) if isinstance(messages, list) else 0
        text_tokens = count_tokens(prompt_text(request, chat=True))
        return max(1, text_tokens + _TEMPLATE_TOKENS_PER_MESSAGE * count + _TEMPLATE_TOKENS_PER_REPLY)
    prompt = request.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # token ids
    return max(1, count_tokens(prompt_text(request, chat=False)))


def natural_output_tokens(text: str, mean_tokens: int) -> int:
    """Where the model would stop of itself (its end-of-sequence token): the same for the same
    prompt, uniform over 1 .. 2 x mean_tokens across prompts."""
    return 1 + zlib.crc32(text.encode()) % max(1, 2 * mean_tokens)
