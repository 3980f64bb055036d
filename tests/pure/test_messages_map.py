"""Anthropic's Messages API mapped to the chat call and back, its stream render, its error shape,
and `x-api-key` read as the key: pure functions (no Redis, no processes)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from starlette.requests import Request

from fleet.classes import FairLine
from fleet.store.events import Chunk, Done
from gateway.auth import bearer
from gateway.errors import APIError, retry_headers
from gateway.messages_map import (
    CountBody,
    MessagesBody,
    chat_body,
    content_blocks,
    error_body,
    error_status,
    message_object,
    stop_of,
)
from gateway.messages_stream import MessagesRender, head_of

TOOL = {"name": "weather", "description": "The weather.", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}}, "cache_control": {"type": "ephemeral"}}


def body(**fields: Any) -> MessagesBody:
    return MessagesBody.model_validate({"model": "routing", "max_tokens": 100, **fields})


def test_a_claude_code_turn_becomes_chat_messages() -> None:
    """System blocks, a system turn, tool_use with its text, tool_result (with an image) before the
    user's text, thinking dropped; cache_control ignored."""
    chat = chat_body(body(
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "sunny"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
                {"type": "text", "text": "and tomorrow?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": "A reminder."}]}],
        tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0, top_k=5, thinking={"type": "adaptive"},
        metadata={"user_id": "x" * 300}, output_config={"effort": "high"}, context_management={"edits": []}))
    assert chat["messages"] == [
        {"role": "system", "content": "You are Claude Code.\nBe brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                     {"type": "text", "text": "and tomorrow?"}]},
        {"role": "system", "content": "A reminder."}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "weather", "parameters": TOOL["input_schema"], "description": "The weather."}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["temperature"] == 0 and chat["max_tokens"] == 100
    assert "top_k" not in chat and "chat_template_kwargs" not in chat  # the sim takes neither
    assert chat["user"].startswith("sha256:") and len(chat["user"]) <= 256
    assert "output_config" not in chat and "context_management" not in chat
    vllm = chat_body(body(messages=[{"role": "user", "content": "hi"}], top_k=5, thinking={"type": "adaptive"}),
                     "vllm")
    assert vllm["top_k"] == 5 and vllm["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize(("choice", "chat"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}})])
def test_tool_choices(choice: dict[str, Any], chat: Any) -> None:
    assert chat_body(body(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=choice))[
        "tool_choice"] == chat


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web"}]},
     "tools[0].input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "tool_choice.type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system[0]"),
])
def test_what_cannot_be_served_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        chat_body(body(**fields))
    assert e.value.status == 400 and e.value.param == param and error_status(e.value) == 400


def test_count_body_needs_no_max_tokens() -> None:
    chat = chat_body(CountBody.model_validate({"model": "routing", "messages": [{"role": "user", "content": "x"}]}))
    assert chat == {"model": "routing", "messages": [{"role": "user", "content": "x"}]}


def test_the_answer_as_content_blocks_and_stop_reasons() -> None:
    blocks = content_blocks({"role": "assistant", "content": "Let me check.", "reasoning_content": "think",
                             "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                 "name": "weather", "arguments": '{"city": "Oslo"}'}}]})
    assert blocks == [{"type": "thinking", "thinking": "think", "signature": ""},
                      {"type": "text", "text": "Let me check."},
                      {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}]
    for finish, reason in (("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use")):
        assert stop_of(Done(1, finish, {}), None) == (reason, None)
    met = Done(1, "stop", {}, choice={"message": {}, "stop_reason": "END"})
    assert stop_of(met, ["END"]) == ("stop_sequence", "END")


def test_a_named_tools_call_is_tool_use_though_chat_says_stop() -> None:
    """Chat ends a call to the tool the caller named with `stop` (vLLM does); Anthropic's answer says tool_use,
    whole and streamed, as vLLM's own Anthropic layer does. Cut off, it is still max_tokens."""
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    stopped = Done(1, "stop", {}, choice={"message": {"role": "assistant", "tool_calls": [call]}})
    whole = message_object("msg_1", "routing", content_blocks(stopped.choice["message"]), stopped)
    assert whole["stop_reason"] == "tool_use"
    assert message_object("msg_1", "routing", [{"type": "text", "text": "hi"}], stopped)["stop_reason"] == "end_turn"
    assert stop_of(Done(1, "length", {}), None, tool_used=True) == ("max_tokens", None)
    render = MessagesRender(head_of("msg_1", "routing", 12), None)
    raw = render.chunk(_chunk({"tool_calls": [{"index": 0, **call}]})) + asyncio.run(render.done(stopped))
    assert _events(raw)[-2]["delta"]["stop_reason"] == "tool_use"


def test_errors_in_anthropics_shape() -> None:
    shed = APIError(429, "the line is long", "at_capacity", code="drain_exceeded", headers=retry_headers(3),
                    tier="routing", priority="speculative", retry_after_s=3)
    assert error_status(shed) == 429 and error_body(shed) == {"type": "error", "error": {
        "type": "rate_limit_error", "message": "the line is long", "code": "drain_exceeded", "tier": "routing",
        "priority": "speculative", "retry_after_s": 3}}
    gone = APIError(503, "Redis is away", "service_unavailable", code="redis_unavailable")
    assert error_status(gone) == 529 and error_body(gone)["error"]["type"] == "overloaded_error"
    field = APIError(422, "max_tokens: required", param="max_tokens", code="invalid_value")
    assert error_status(field) == 400 and error_body(field)["error"]["param"] == "max_tokens"
    assert error_body(APIError(404, "no model", code="model_not_found"))["error"]["type"] == "not_found_error"


def _chunk(delta: dict[str, Any]) -> Chunk:
    return Chunk(orjson.dumps({"delta": delta, "logprobs": None})[1:-1])


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in raw.decode().strip().split("\n\n"):
        kind, data = frame.split("\n")
        assert kind == "event: " + orjson.loads(data[6:])["type"]
        out.append(orjson.loads(data[6:]))
    return out


def test_the_stream_in_anthropics_event_order() -> None:
    render = MessagesRender(head_of("msg_1", "routing", 12), None)
    raw = render.chunk(_chunk({"content": "Let "})) + render.chunk(_chunk({"content": "me."}))
    raw += render.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                "function": {"name": "weather", "arguments": ""}}]}))
    raw += render.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}))
    raw += render.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}))
    raw += asyncio.run(render.done(Done(1, "tool_calls", {"prompt_tokens": 12, "completion_tokens": 9})))
    ev = _events(raw)
    assert [e["type"] for e in ev] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert ev[0]["message"]["usage"]["input_tokens"] == 12 and ev[0]["message"]["content"] == []
    assert ev[6]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in ev[7:9]) == '{"city":"Oslo"}' and ev[7]["index"] == 1
    assert ev[10]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert ev[10]["usage"]["output_tokens"] == 9
    failed = MessagesRender(head_of("msg_2", "routing", 1), None)
    [start, _ping, err] = _events(failed.error(APIError(504, "deadline passed", "deadline_exceeded",
                                                 code="deadline_exceeded")))
    assert start["type"] == "message_start" and err["error"]["type"] == "timeout_error"


def test_x_api_key_is_the_key_and_claude_codes_session_is_a_flow() -> None:
    def req(*headers: tuple[bytes, bytes]) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/v1/messages", "headers": list(headers)})

    assert bearer(req((b"x-api-key", b"sk-1"))) == "Bearer sk-1"
    assert bearer(req((b"authorization", b"Bearer sk-2"), (b"x-api-key", b"sk-1"))) == "Bearer sk-2"
    assert bearer(req()) is None
    assert "x-claude-code-session-id" in FairLine().session_headers


def test_reasoning_streams_as_a_thinking_block_before_the_text() -> None:
    render = MessagesRender(head_of("msg_3", "routing", 3), ["END"])
    raw = render.chunk(_chunk({"reasoning_content": "hm"})) + render.chunk(_chunk({"content": "Hi"}))
    raw += asyncio.run(render.done(Done(1, "stop", {"prompt_tokens": 3, "completion_tokens": 2},
                                        extra={"stop_reason": "END"})))
    ev = [e for e in _events(raw) if e["type"] != "ping"]
    assert [(e["type"], e.get("content_block", e.get("delta", {})).get("type")) for e in ev[1:7]] == [
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_stop", None)]
    assert ev[7]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
