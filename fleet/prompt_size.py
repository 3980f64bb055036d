"""How big a call's prompt is before any tokenizer runs: one estimate, shared.

The gateway prices admission and budgets with it, and the `sim` engine counts its prompt
tokens with it, so the two agree. About four characters a token, for everything the engine
will render into the prompt: each message's role, text, name, tool-call id and tool calls,
and the call's tool schemas and response format (an agent's tools can be most of its
prompt). A part that is not text (an image, audio, a file) counts a fixed `PART_TOKENS`:
its bytes say little about what an engine makes of it.
"""

from __future__ import annotations

from typing import Any

import orjson

PART_TOKENS = 765  # a part that is not text: about what one detailed image costs at OpenAI
_TURN_CHARS = 3  # the separators a chat template adds around each turn


def _chars(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    return len(orjson.dumps(value))


def _message(m: Any) -> tuple[int, int]:
    """(characters, fixed tokens) of one chat message."""
    if not isinstance(m, dict):
        return _chars(m), 0
    chars = _TURN_CHARS + _chars(m.get("role")) + _chars(m.get("name")) + _chars(m.get("tool_call_id"))
    chars += _chars(m.get("tool_calls"))
    tokens = 0
    content = m.get("content")
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                chars += _chars(part.get("text"))
            else:
                tokens += PART_TOKENS
    else:
        chars += _chars(content)
    return chars, tokens


def estimate_prompt_tokens(kind: str, body: dict[str, Any]) -> int:
    """Prompt tokens of a chat or completion body (as the caller sent it), at least one."""
    chars = tokens = 0
    if kind == "chat":
        for m in body.get("messages") or ():
            c, t = _message(m)
            chars, tokens = chars + c, tokens + t
        chars += _chars(body.get("tools")) + _chars(body.get("response_format"))
    else:
        prompt = body.get("prompt")
        chars = _chars(prompt[0] if isinstance(prompt, list) and prompt else prompt)
    return max(1, (chars + 3) // 4 + tokens)
