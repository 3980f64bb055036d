"""OpenAI's streamed shapes, merged: pure functions over the dicts engines send.

A chat stream sends its answer in deltas: text in `content`, `reasoning_content` and
`refusal` fragments, and tool calls as fragments keyed by `index` (the first with `id`,
`type` and `function.name`, the rest with pieces of `function.arguments`). Clients merge
them the same way; so does the fleet, in two places: a worker writing a burst of deltas as
one chunk (`merge_delta`: the result is still a delta), and a worker answering a call that
was not streamed from an engine that only streams (`message_of`: the merged delta as the
message OpenAI's non-streamed answer holds).
"""

from __future__ import annotations

from typing import Any

_TEXT = ("content", "reasoning_content", "reasoning", "refusal")


def merge_delta(into: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """`delta` merged into `into` (changed in place and returned): text members concatenated,
    tool-call fragments merged by index, anything else the later value."""
    for key, value in delta.items():
        if value is None:
            into.setdefault(key, None)
        elif key in _TEXT and isinstance(value, str):
            into[key] = (into.get(key) or "") + value
        elif key == "tool_calls" and isinstance(value, list):
            into["tool_calls"] = _merge_tool_calls(into.get("tool_calls") or [], value)
        else:
            into[key] = value
    return into


def _merge_tool_calls(calls: list[dict[str, Any]], fragments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_index = {c.get("index", i): c for i, c in enumerate(calls)}
    for i, frag in enumerate(fragments):
        index = frag.get("index", len(by_index) if "id" in frag else i)
        call = by_index.get(index)
        if call is None:
            by_index[index] = call = {"index": index}
            calls.append(call)
        for key, value in frag.items():
            if key == "function" and isinstance(value, dict):
                fn = call.setdefault("function", {})
                for fk, fv in value.items():
                    if fk == "arguments" and isinstance(fv, str):
                        fn["arguments"] = fn.get("arguments", "") + fv
                    elif fv is not None:
                        fn[fk] = fv
            elif value is not None and key != "index":
                call[key] = value
    return calls


def merge_logprobs(into: dict[str, Any] | None, logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Streamed logprobs merged: every list member concatenated (chat's `content` and `refusal`;
    a completion's `tokens`, `token_logprobs`, `top_logprobs` and `text_offset`)."""
    if not logprobs:
        return into
    if into is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in logprobs.items()}
    for key, value in logprobs.items():
        if isinstance(value, list):
            into[key] = (into.get(key) or []) + value
        elif value is not None:
            into[key] = value
    return into


def message_of(delta: dict[str, Any]) -> dict[str, Any]:
    """The merged deltas of a chat answer as its message: `content` null when it made only
    tool calls, tool calls in index order without their index."""
    message: dict[str, Any] = {"role": delta.get("role") or "assistant"}
    calls = sorted(delta.get("tool_calls") or [], key=lambda c: c.get("index", 0))
    content = delta.get("content")
    message["content"] = content if content or not calls else None
    for key, value in delta.items():
        if key not in ("role", "content", "tool_calls") and value is not None:
            message[key] = value
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message
