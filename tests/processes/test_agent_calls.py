"""Agents' calls whole, through a real fleet (gateway, Redis, workers), with the `openai` client.

The `analysis` tier runs the `openai` engine in front of a scripted upstream that answers as
OpenAI does (tests/agent_upstream.py): what the agent gets back must be what the upstream
said, field for field, and what the upstream got must be what the agent sent. The `routing`
tier runs the `sim` engine, which answers tools with calls whose arguments fit the schema.
Covered: parallel tool calls, a named tool_choice, a tool-result turn, json_schema, logprobs,
streamed and not, and an upstream's 400 as the caller's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest

from fleet.chat_shapes import merge_delta, merge_logprobs, message_of
from tests.agent_upstream import FINGERPRINT, MODEL, Upstream, agent_fleet, answer
from tests.harness import Fleet

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather and time in Oslo?"}]
PLAN_SCHEMA = {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}},
                                                "done": {"type": "boolean"}, "count": {"type": "integer"}},
               "required": ["steps", "done", "count"], "additionalProperties": False}
PLAN = {"type": "json_schema", "json_schema": {"name": "plan", "strict": True, "schema": PLAN_SCHEMA}}


@pytest.fixture(scope="module")
def agents(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Upstream]]:
    with agent_fleet(redis_url, tmp_path_factory.mktemp("agents")) as fleet_and_upstream:
        yield fleet_and_upstream


def client(f: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0)


def post(f: Fleet, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{f.base_url}/v1/chat/completions", json=body, timeout=30)


def streamed(f: Fleet, body: dict[str, Any]) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
    """A streamed call's merged delta, its finish reason and its chunks, read as SSE."""
    chunks = []
    with httpx.stream("POST", f"{f.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[6:]))
    merged: dict[str, Any] = {}
    finish = None
    for c in chunks:
        for choice in c["choices"]:
            merge_delta(merged, choice["delta"])
            finish = choice["finish_reason"] or finish
    return merged, finish, chunks


# --- the openai engine: what the upstream said, field for field ---------------------------------


def test_parallel_tool_calls_come_back_as_the_upstream_made_them(agents: tuple[Fleet, Upstream]) -> None:
    f, up = agents
    body = {"model": "analysis", "messages": ASK, "tools": [WEATHER, CLOCK], "parallel_tool_calls": True}
    r = post(f, body)
    assert r.status_code == 200, r.text
    got = r.json()
    raw, sent = up.seen[-1]
    message, finish = answer(sent)
    assert got["choices"] == [{"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}]
    assert len(got["choices"][0]["message"]["tool_calls"]) == 2 and got["choices"][0]["message"]["content"] is None
    assert got["model"] == MODEL and got["system_fingerprint"] == FINGERPRINT  # the upstream's
    assert got["id"].startswith("chatcmpl-") and got["id"][9:] == r.headers["x-request-id"]  # the fleet's
    assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the upstream's usage, whole
    # The tool schemas reached the upstream byte for byte, strict and additionalProperties included.
    assert orjson.dumps([WEATHER, CLOCK]) in raw and sent["parallel_tool_calls"] is True
    # Streamed: the fragments merge, by index, into the same calls.
    merged, finish, chunks = streamed(f, body)
    assert finish == "tool_calls" and message_of(merged)["tool_calls"] == message["tool_calls"]
    assert all(c["model"] == MODEL for c in chunks)


def test_named_tool_choice_and_a_tool_result_turn(agents: tuple[Fleet, Upstream]) -> None:
    f, up = agents
    c = client(f)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model="analysis", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and orjson.loads(call.function.arguments) == {"zone": "Oslo"}
    assert up.seen[-1][1]["tool_choice"] == named
    # The agent runs the tool and sends the result back: the upstream sees its own call, by id, and
    # answers from the result (a fleet that lost tool_calls or tool_call_id gets OpenAI's 400 here).
    turns = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "14:05 CET"}]
    for stream in (False, True):
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="analysis", messages=turns, tools=[WEATHER, CLOCK], stream=True) if ch.choices)
        else:
            text = c.chat.completions.create(model="analysis", messages=turns, tools=[WEATHER, CLOCK]).choices[0]
            text = text.message.content
        assert text == "Done. The tool answered: 14:05 CET"
        sent = up.seen[-1][1]["messages"]
        assert sent[1]["tool_calls"][0]["id"] == call.id and sent[2]["tool_call_id"] == call.id


def test_json_schema_and_logprobs(agents: tuple[Fleet, Upstream]) -> None:
    f, up = agents
    body = {"model": "analysis", "messages": ASK, "response_format": PLAN, "logprobs": True, "top_logprobs": 2}
    got = post(f, body).json()
    message, _ = answer(up.seen[-1][1])
    assert orjson.loads(got["choices"][0]["message"]["content"]) == orjson.loads(message["content"])
    jsonschema.validate(orjson.loads(got["choices"][0]["message"]["content"]), PLAN_SCHEMA)
    assert up.seen[-1][1]["response_format"] == PLAN  # strict and additionalProperties reached it
    logprobs = got["choices"][0]["logprobs"]
    assert len(logprobs["content"]) > 3 and all(len(t["top_logprobs"]) == 2 for t in logprobs["content"])
    # Streamed: the chunks' logprobs, merged, are the same tokens.
    merged, finish, chunks = streamed(f, body)
    lp = None
    for ch in chunks:
        for choice in ch["choices"]:
            lp = merge_logprobs(lp, choice["logprobs"])
    assert finish == "stop" and merged["content"] == message["content"]
    assert [t["token"] for t in lp["content"]] == [t["token"] for t in logprobs["content"]]  # type: ignore[index]


def test_streamed_usage_is_the_upstreams_when_asked(agents: tuple[Fleet, Upstream]) -> None:
    f, _ = agents
    _, _, chunks = streamed(f, {"model": "analysis", "messages": ASK, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    _, _, chunks = streamed(f, {"model": "analysis", "messages": ASK})
    assert all("usage" not in c for c in chunks)  # not asked: not sent


def test_an_upstream_400_is_the_callers_400_with_its_message(agents: tuple[Fleet, Upstream]) -> None:
    f, _ = agents
    orphan_result = [*ASK, {"role": "tool", "tool_call_id": "call_nobody_made", "content": "x"}]
    r = post(f, {"model": "analysis", "messages": orphan_result})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "must be a response to a preceding message" in err["message"]
    assert err["param"] == "messages"


# --- the sim engine: an agent's loop with no GPU and no model -----------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_sim_answers_tools_with_calls_that_fit_their_schema(agents: tuple[Fleet, Upstream], stream: bool) -> None:
    f, _ = agents
    body = {"model": "routing", "messages": ASK, "tools": [WEATHER, CLOCK], "parallel_tool_calls": True}
    if stream:
        merged, finish, _ = streamed(f, body)
        message = message_of(merged)
    else:
        choice = post(f, body).json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
    assert finish == "tool_calls" and message["content"] is None
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    for c, tool in zip(calls, (WEATHER, CLOCK), strict=True):
        jsonschema.validate(orjson.loads(c["function"]["arguments"]), tool["function"]["parameters"])
    # The tool's result goes back; the sim answers in text, from it.
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls[:1]},
             {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"}]
    r = client(f).chat.completions.create(model="routing", messages=turns, tools=[WEATHER])
    assert r.choices[0].finish_reason == "stop" and "sunny, 21 C" in (r.choices[0].message.content or "")


def test_sim_answers_json_schema_named_tools_and_logprobs(agents: tuple[Fleet, Upstream]) -> None:
    f, _ = agents
    c = client(f)
    r = c.chat.completions.create(model="routing", messages=ASK, response_format=PLAN)  # type: ignore[arg-type]
    jsonschema.validate(orjson.loads(r.choices[0].message.content or ""), PLAN_SCHEMA)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model="routing", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named)  # type: ignore[arg-type]
    assert [t.function.name for t in r.choices[0].message.tool_calls or []] == ["get_time"]
    r = c.chat.completions.create(model="routing", messages=ASK, logprobs=True, top_logprobs=1, max_tokens=5,
                                  extra_body={"ignore_eos": True})  # exactly 5 tokens, each with its logprob
    assert r.choices[0].logprobs and len(r.choices[0].logprobs.content or []) == 5
    bad = {"type": "function", "function": {"name": "no_such_tool"}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="routing", messages=ASK, tools=[WEATHER], tool_choice=bad)  # type: ignore[arg-type]
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]
