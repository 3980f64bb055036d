"""The Responses API's map to the chat call and back, and its stream render: pure functions over
the request, the chat answer and the chat deltas a call streams (no Redis, no processes)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from fleet.store.events import Chunk, Done
from gateway.errors import APIError
from gateway.responses_map import chat_body, chat_messages, input_items, output_items, response_object, status_of
from gateway.responses_schema import ResponsesBody, unsupported_fields
from gateway.responses_stream import ResponsesRender


def body(**fields: Any) -> ResponsesBody:
    return ResponsesBody.model_validate({"model": "routing", **fields})


def test_input_items_become_chat_turns() -> None:
    items = input_items(body(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                   "text": "Oslo?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Bergen"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                     {"type": "input_image", "image_url": "https://x/y.png"}]}]))
    assert chat_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [  # the text and the calls: one turn
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "user", "content": [{"type": "text", "text": "and this?"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]


def test_a_string_input_is_one_user_message_and_instructions_are_not_stored() -> None:
    b = body(input="hi", instructions="Be brief.")
    assert input_items(b) == [{"type": "message", "role": "user", "content": "hi"}]
    assert chat_body(b, input_items(b))["messages"][0] == {"role": "system", "content": "Be brief."}


def test_the_request_fields_map_to_chat() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    b = body(input="x", stream=True, max_output_tokens=50, temperature=0.5, top_p=0.9, parallel_tool_calls=False,
             tools=[{"type": "function", "name": "f", "parameters": schema, "strict": True}],
             tool_choice={"type": "function", "name": "f"}, reasoning={"effort": "low"},
             text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}})
    chat = chat_body(b, input_items(b))
    assert chat == {
        "model": "routing", "messages": [{"role": "user", "content": "x"}], "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
        "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "reasoning_effort": "low"}
    assert chat_body(body(input="x", text={"format": {"type": "json_object"}}), [])["response_format"] == {
        "type": "json_object"}


def test_a_chat_answer_becomes_output_items() -> None:
    items = output_items({"role": "assistant", "content": "Checking.", "reasoning_content": "They want weather.",
                          "tool_calls": [{"id": "call_1", "type": "function",
                                          "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]})
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "They want weather."}]
    assert items[1]["content"][0]["text"] == "Checking." and items[1]["role"] == "assistant"
    assert {k: items[2][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'}
    assert all(len(i["id"]) > 40 for i in items)  # ids of 192 random bits
    refused = output_items({"role": "assistant", "content": None, "refusal": "I can't."})
    assert refused[0]["content"] == [{"type": "refusal", "refusal": "I can't."}]
    assert status_of("length") == ("incomplete", {"reason": "max_output_tokens"})
    assert status_of("tool_calls") == ("completed", None)


@pytest.mark.parametrize(("data", "param"), [
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "prompt": {"id": "p"}}, "prompt"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": "x", "tools": [{"type": "file_search"}]}, "tools.0.type"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input.0.type")])
def test_unsupported_fields_are_named(data: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        unsupported_fields(data)
    assert (e.value.status, e.value.code, e.value.param) == (400, "unsupported_parameter", param)


def test_neutral_fields_pass() -> None:
    unsupported_fields({"model": "m", "input": "x", "include": [], "truncation": "disabled", "store": True,
                        "prompt_cache_key": "k", "service_tier": "auto", "background": False})


def _chunk(delta: dict[str, Any]) -> Chunk:
    return Chunk(orjson.dumps({"delta": delta, "logprobs": None})[1:-1])


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            head, data = block.split(b"\n", 1)
            ev = orjson.loads(data.removeprefix(b"data: "))
            assert head == b"event: " + ev["type"].encode()
            out.append(ev)
    return out


def test_the_render_streams_items_in_openai_order() -> None:
    kept: list[list[dict[str, Any]]] = []

    async def finish(items: list[dict[str, Any]], done: Done) -> dict[str, Any]:
        kept.append([dict(i) for i in items])
        return response_object("resp_x", body(input="x"), 0, output=items, done=done)

    render = ResponsesRender(response_object("resp_x", body(input="x"), 0), finish)
    raw = render.chunk(_chunk({"content": "Let me "})) + render.chunk(_chunk({"content": "check."}))
    raw += render.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                "function": {"name": "weather", "arguments": '{"ci'}}]}))
    raw += render.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Oslo"}'}}]}))
    raw += asyncio.run(render.done(Done(attempt=1, finish_reason="tool_calls",
                                        usage={"prompt_tokens": 9, "completion_tokens": 6})))
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    assert final["output"][1]["arguments"] == '{"city":"Oslo"}' and final["output"][1]["call_id"] == "call_1"
    assert final["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 6,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    assert kept and kept[0][1]["status"] == "completed"  # stored before the completed event was written


def test_the_render_ends_a_failure_with_response_failed() -> None:
    async def finish(items: list[dict[str, Any]], done: Done) -> dict[str, Any]:
        raise AssertionError("a failed call is not stored")

    render = ResponsesRender(response_object("resp_x", body(input="x"), 0), finish)
    raw = render.chunk(_chunk({"content": "half"}))
    raw += render.error(APIError(502, "the worker serving this stream was lost", "worker_lost", code="worker_lost"))
    events = _events(raw)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "worker_lost", "message": "the worker serving this stream "
                                                                                  "was lost"}
    assert events[-2]["type"] == "response.output_item.done"  # the open item closed first


def test_the_render_streams_reasoning_before_the_answer() -> None:
    async def finish(items: list[dict[str, Any]], done: Done) -> dict[str, Any]:
        return response_object("resp_x", body(input="x"), 0, output=items, done=done)

    render = ResponsesRender(response_object("resp_x", body(input="x"), 0), finish)
    raw = render.chunk(_chunk({"reasoning_content": "They ask "})) + render.chunk(_chunk({"reasoning_content": "x."}))
    raw += render.chunk(_chunk({"content": "Yes."}))
    raw += asyncio.run(render.done(Done(attempt=1, finish_reason="length", usage={})))
    events = _events(raw)
    kinds = [e["type"] for e in events]
    assert kinds[2:7] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.output_item.done"], kinds
    assert kinds[-1] == "response.incomplete"  # cut by max_output_tokens
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "They ask x."
