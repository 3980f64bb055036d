"""The Responses API through a real fleet, with the real clients: the `openai` client's
`responses.create` and `responses.stream` (streamed and not, with tools and
`function_call_output` turns), conversations continued by `previous_response_id` on another
gateway process and after a restart, and the OpenAI Agents SDK left on its default model (the
Responses one) running its tool loop with its turns on different gateways. Each on the `sim`
engine (`routing`) and on the `openai` engine in front of a scripted upstream (`analysis`,
tests/agent_upstream.py), which answers chat completions: the gateway maps one to the other.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.agent_upstream import Upstream, agent_fleet
from tests.harness import Fleet

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

TIERS = ["routing", "analysis"]
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class Gateways:
    """Two gateway processes on one fleet's Redis and namespace, either of which can be restarted."""

    def __init__(self, f: Fleet) -> None:
        self.f = f
        self.extra = [Fleet(f.redis_url, config_path=f.config_path, namespace=f.namespace) for _ in range(2)]
        for g in self.extra:
            g.start_gateway()

    def url(self, i: int) -> str:
        return f"{self.extra[i].base_url}/v1"

    def client(self, i: int) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(i), api_key="unused", max_retries=0)

    def restart(self, i: int) -> None:
        """Stop gateway `i` (SIGTERM, waited for) and start a new process in its place."""
        g = self.extra[i]
        g.stop()
        g.procs.clear()
        g.start_gateway()

    def stop(self) -> None:
        for g in self.extra:
            g.stop()


@pytest.fixture(scope="module")
def fleet2(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateways, Upstream]]:
    with agent_fleet(redis_url, tmp_path_factory.mktemp("responses")) as (f, up):
        gws = Gateways(f)
        try:
            yield gws, up
        finally:
            gws.stop()


def _events(stream: Any) -> list[Any]:
    return list(stream)


@pytest.mark.parametrize("tier", TIERS)
def test_create_a_tool_loop_whole(fleet2: tuple[Gateways, Upstream], tier: str) -> None:
    """A function call, its output sent back as a `function_call_output` item with the whole
    conversation, and the answer that quotes it."""
    gws, _ = fleet2
    c = gws.client(0)
    first = c.responses.create(model=tier, input="Weather in Oslo?", tools=[WEATHER], instructions="Use the tool.")
    assert first.status == "completed" and first.id.startswith("resp_") and len(first.id) >= 5 + 32
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "weather" and call.call_id and '"city"' in call.arguments
    assert first.usage is not None and first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    second = c.responses.create(model=tier, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny in Oslo"}])
    assert "sunny in Oslo" in second.output_text


@pytest.mark.parametrize("tier", TIERS)
def test_stream_events_in_openai_order(fleet2: tuple[Gateways, Upstream], tier: str) -> None:
    gws, _ = fleet2
    c = gws.client(1)
    with c.responses.stream(model=tier, input="Weather in Oslo?", tools=[WEATHER]) as s:
        events = _events(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [call] = [o for o in final.output if o.type == "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and '"city"' in args
    # The tool's result streamed back: text deltas that add up to the answer, which quotes it.
    with c.responses.stream(model=tier, tools=[WEATHER], previous_response_id=final.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny in Oslo"}]) as s:
        events = _events(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"], kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and "sunny in Oslo" in text


@pytest.mark.parametrize("tier", TIERS)
def test_continued_on_another_gateway_and_after_a_restart(fleet2: tuple[Gateways, Upstream], tier: str) -> None:
    gws, up = fleet2
    first = gws.client(0).responses.create(model=tier, input="Weather in Oslo?", tools=[WEATHER])
    [call] = [o for o in first.output if o.type == "function_call"]
    second = gws.client(1).responses.create(model=tier, tools=[WEATHER], previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny in Oslo"}])
    assert "sunny in Oslo" in second.output_text
    gws.restart(0)  # the gateway that answered the first turn
    third = gws.client(0).responses.create(model=tier, previous_response_id=second.id, input="Thanks. And Bergen?")
    assert third.status == "completed" and third.previous_response_id == second.id  # the sim's answer ends too
    # The whole conversation ran: every turn reached the engine (tool call, its result, the new question).
    if tier == "routing":  # the sim counts the prompt it got (the scripted upstream says 11 whatever it gets)
        assert third.usage is not None and first.usage is not None
        assert third.usage.input_tokens > first.usage.input_tokens
    else:
        messages = up.seen[-1][1]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
        assert messages[1]["tool_calls"][0]["id"] == call.call_id
    # Read back from either gateway; deleted, it cannot be continued.
    assert gws.client(1).responses.retrieve(third.id).output_text == third.output_text
    gws.client(1).responses.delete(third.id)
    with pytest.raises(openai.NotFoundError) as e:
        gws.client(0).responses.create(model=tier, previous_response_id=third.id, input="again")
    assert e.value.body["code"] == "response_not_found" and e.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(fleet2: tuple[Gateways, Upstream]) -> None:
    gws, _ = fleet2
    r = gws.client(0).responses.create(model="routing", input="hello", store=False, max_output_tokens=4)
    assert r.store is False and r.output_text
    assert not gws.f.r.exists(f"{gws.f.namespace}:resp:{r.id}")
    with pytest.raises(openai.NotFoundError):
        gws.client(1).responses.retrieve(r.id)


def test_structured_output_and_typed_refusals(fleet2: tuple[Gateways, Upstream]) -> None:
    gws, _ = fleet2
    c = gws.client(0)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
              "required": ["city", "celsius"], "additionalProperties": False}
    r = c.responses.create(model="analysis", input="Forecast for Oslo", text={"format": {
        "type": "json_schema", "name": "forecast", "schema": schema, "strict": True}})
    assert r.output_text == '{"city":"Oslo","celsius":7}'
    for kwargs, status, code, param in (
            ({"model": "nope", "input": "x"}, 404, "model_not_found", "model"),
            ({"model": "routing", "input": "x", "tools": [{"type": "web_search"}]}, 400, "unsupported_parameter",
             "tools.0.type"),
            ({"model": "routing", "input": "x", "extra_body": {"background": True}}, 400, "unsupported_parameter",
             "background"),
            ({"model": "routing", "input": [{"type": "item_reference", "id": "x"}]}, 400, "unsupported_parameter",
             "input.0.type"),
            ({"model": "routing", "input": "x", "max_output_tokens": 10**7}, 422, "invalid_value",
             "max_output_tokens"),
            ({"model": "routing", "input": "x", "previous_response_id": "resp_" + "0" * 48}, 404,
             "response_not_found", "previous_response_id")):
        with pytest.raises(openai.APIStatusError) as e:
            c.responses.create(**kwargs)  # type: ignore[call-overload]
        assert (e.value.status_code, e.value.body["code"], e.value.body["param"]) == (status, code, param)


def test_a_deadline_ends_the_stream_with_response_failed(fleet2: tuple[Gateways, Upstream]) -> None:
    gws, _ = fleet2
    c = openai.OpenAI(base_url=gws.url(0), api_key="unused", max_retries=0,
                      default_headers={"X-Deadline-Ms": "300"})
    # No max_output_tokens: admitted on the tier's typical answer; told to ignore its end (vLLM's
    # ignore_eos), the sim talks to the tier's default bound (a second and more), so the deadline
    # passes mid-stream.
    with c.responses.stream(model="routing", input="talk for long", extra_body={"ignore_eos": True}) as s:
        events = _events(s)
    assert events[0].type == "response.created" and "response.output_text.delta" in [e.type for e in events]
    assert events[-1].type == "response.failed", [e.type for e in events[-3:]]
    assert events[-1].response.error is not None and events[-1].response.error.code == "deadline_exceeded"


class Alternating(httpx.AsyncBaseTransport):
    """Sends each request to the next gateway in turn; `before[n]` runs (in a thread) before request n."""

    def __init__(self, gws: Gateways, before: dict[int, Callable[[], None]]) -> None:
        self.gws, self.before, self.n = gws, before, 0
        self.ports: list[int] = []
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if (hook := self.before.get(self.n)) is not None:
            await asyncio.to_thread(hook)
        g = self.gws.extra[self.n % len(self.gws.extra)]
        self.n += 1
        self.ports.append(g.port)
        request.url = request.url.copy_with(port=g.port)
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tier", TIERS)
async def test_agents_sdk_default_model_across_gateways(fleet2: tuple[Gateways, Upstream], tier: str,
                                                        stream: bool) -> None:
    """The Agents SDK on its default model provider (the Responses API), chaining its turns by
    `previous_response_id`: two tool loops, every request on the other gateway from the last,
    the first gateway restarted between the two runs."""
    from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)
    gws, up = fleet2
    ran: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    transport = Alternating(gws, {2: lambda: gws.restart(0)})
    client = openai.AsyncOpenAI(base_url=gws.url(0), api_key="unused", max_retries=0,
                                http_client=httpx.AsyncClient(transport=transport))
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
    agent = Agent(name="forecaster", instructions="Use the tool.", tools=[weather], model=tier)

    async def run(question: str, previous: str | None) -> Any:
        if stream:
            result = Runner.run_streamed(agent, question, run_config=config, previous_response_id=previous,
                                         auto_previous_response_id=True)
            async for _ in result.stream_events():
                pass
            return result
        return await Runner.run(agent, question, run_config=config, previous_response_id=previous,
                                auto_previous_response_id=True)

    first = await run("Weather in Oslo?", None)
    assert ran and f"sunny in {ran[-1]}" in str(first.final_output)
    second = await run("And in Bergen?", first.last_response_id)
    assert len(ran) == 2 and f"sunny in {ran[-1]}" in str(second.final_output)
    assert len(transport.ports) == 4 and len(set(transport.ports)) == 3  # two gateways, one of them restarted
    if tier == "analysis":  # the second run's engine call held the first run's turns, from the store
        roles = [m["role"] for m in up.seen[-1][1]["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool"], roles
