"""Anthropic's Messages API through a real fleet, with the real `anthropic` client:
`messages.create` and `messages.stream`, a tool loop (tool_use, then tool_result, then text),
`count_tokens`, and a key's rpm refusal that the SDK reads as a RateLimitError with Retry-After.
Each on the `sim` engine (`routing`) and on the `openai` engine in front of a scripted upstream
(`analysis`, tests/agent_upstream.py), which answers chat completions: the gateway maps one to
the other, on the same line as chat.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.agent_upstream import Upstream, agent_fleet
from tests.harness import ROOT, Fleet, serving, wait_until

TIERS = ["routing", "analysis"]
WEATHER = {"name": "weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Upstream]]:
    with agent_fleet(redis_url, tmp_path_factory.mktemp("messages")) as got:
        yield got


def client(f: Fleet, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f.base_url, api_key="unused", max_retries=0, **kw)


@pytest.mark.parametrize("tier", TIERS)
def test_create_whole_is_a_message(fleet: tuple[Fleet, Upstream], tier: str) -> None:
    """Plain text, with Claude Code's extras (system blocks with cache_control, a system turn,
    metadata.user_id, thinking, output_config), none of them refused."""
    f, _ = fleet
    msg = client(f).messages.create(
        model=tier, max_tokens=32000, system=[{"type": "text", "text": "Be brief.", "cache_control": {
            "type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi.", "cache_control": {
            "type": "ephemeral"}}]}, {"role": "system", "content": "A reminder."}],  # type: ignore[typeddict-item]
        metadata={"user_id": '{"device_id": "' + "d" * 300 + '"}'},
        extra_body={"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
                    "context_management": {"edits": []}},
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
        extra_query={"beta": "true"}, timeout=60)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text  # type: ignore[union-attr]
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0


@pytest.mark.parametrize("tier", TIERS)
def test_a_tool_loop_whole_and_streamed(fleet: tuple[Fleet, Upstream], tier: str) -> None:
    """tool_use (its input made from the schema), the tool_result sent back, and a final text that
    quotes it; the streamed call gives the same blocks through Anthropic's events."""
    f, _ = fleet
    c = client(f)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    first = c.messages.create(model=tier, max_tokens=200, tools=[WEATHER], messages=ask)  # type: ignore[list-item]
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "weather" and isinstance(use.input, dict) and isinstance(use.input.get("city"), str)
    with c.messages.stream(model=tier, max_tokens=200, tools=[WEATHER], messages=ask) as s:  # type: ignore[list-item]
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    assert streamed.stop_reason == "tool_use"
    [suse] = [b for b in streamed.content if b.type == "tool_use"]
    assert suse.name == "weather" and suse.input == use.input
    turns = [*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21C"}]}]
    final = c.messages.create(model=tier, max_tokens=200, tools=[WEATHER], messages=turns)  # type: ignore[arg-type]
    assert final.stop_reason == "end_turn"
    assert "Sunny, 21C" in "".join(b.text for b in final.content if b.type == "text")


@pytest.mark.parametrize("tier", TIERS)
def test_stream_text(fleet: tuple[Fleet, Upstream], tier: str) -> None:
    """Text deltas, then message_delta with the stop reason and usage (the sim writes exactly
    max_tokens with ignore_eos; the scripted upstream's short answer ends of its own accord)."""
    f, _ = fleet
    with client(f).messages.stream(model=tier, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                                   extra_body={"ignore_eos": True}) as s:
        text = "".join(s.text_stream)
        msg = s.get_final_message()
    assert text and msg.content[0].text == text  # type: ignore[union-attr]
    assert msg.stop_reason == ("max_tokens" if tier == "routing" else "end_turn") and msg.usage.output_tokens > 0


def test_count_tokens_and_anthropic_errors(fleet: tuple[Fleet, Upstream]) -> None:
    """count_tokens is the fleet's own estimate (more tools, more tokens); an unknown model is a
    404 not_found_error, a missing max_tokens a 400 invalid_request_error naming it."""
    f, _ = fleet
    c = client(f)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = c.messages.count_tokens(model="routing", messages=ask)  # type: ignore[arg-type]
    tooled = c.messages.count_tokens(model="routing", messages=ask, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    assert 0 < plain.input_tokens < tooled.input_tokens
    with pytest.raises(anthropic.NotFoundError) as nf:
        c.messages.create(model="no-such-tier", max_tokens=5, messages=ask)  # type: ignore[arg-type]
    assert nf.value.body["type"] == "error" and nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:  # the fleet's headers are read as on chat
        c.messages.create(model="routing", max_tokens=5, messages=ask, extra_headers={"X-Priority": "urgent"})  # type: ignore[arg-type]
    assert bad.value.body["error"]["param"] == "X-Priority"  # type: ignore[index]
    r = httpx.post(f"{f.base_url}/v1/messages", json={"model": "routing", "messages": ask}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == "max_tokens"


def test_a_keys_rpm_refusal_is_a_rate_limit_error_with_retry_after(redis_url: str) -> None:
    """A stored key (sent as `x-api-key`, as the SDK does) with rpm 1: the second call is a 429
    `rate_limit_error` the SDK raises as RateLimitError, with the fleet's retry headers."""
    with serving(redis_url) as f:
        made = subprocess.run([sys.executable, "-m", "fleetctl", "keys", "add", "desk", "--rpm", "1"], env=f.env,
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        secret = made.stdout.strip()
        wait_until(lambda: httpx.get(f"{f.base_url}/v1/models").status_code == 200
                   and httpx.post(f"{f.base_url}/v1/messages/count_tokens", json={
                       "model": "routing", "messages": []}).status_code == 401, 10, what="the key known")
        c = anthropic.Anthropic(base_url=f.base_url, api_key=secret, max_retries=0)
        ask = [{"role": "user", "content": "Hi"}]
        assert c.messages.create(model="routing", max_tokens=5, messages=ask).type == "message"  # type: ignore[arg-type]
        with pytest.raises(anthropic.RateLimitError) as e:
            c.messages.create(model="routing", max_tokens=5, messages=ask)  # type: ignore[arg-type]
        err = e.value
        assert err.status_code == 429 and err.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        assert err.body["error"]["code"] == "rate_limited" and err.body["error"]["retry_after_s"] >= 1  # type: ignore[index]
        assert int(err.response.headers["retry-after"]) >= 1 and "retry-after-ms" in err.response.headers
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=f.base_url, api_key="wrong", max_retries=0).messages.create(
                model="routing", max_tokens=5, messages=ask)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tier", TIERS)
def test_langchain_chat_anthropic_runs_its_tool_loop(fleet: tuple[Fleet, Upstream], tier: str, stream: bool) -> None:
    """LangGraph's ReAct loop over LangChain's ChatAnthropic pointed at the fleet by base URL:
    the tool called with the input the model made, its result sent back, a final text quoting it."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    f, _ = fleet
    ran: list[str] = []

    def weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"Sunny in {city}"

    tools = [tool(weather)]
    llm = ChatAnthropic(model_name=tier, base_url=f.base_url, api_key="unused", max_tokens=200,  # type: ignore[arg-type, call-arg]
                        streaming=stream, max_retries=0, timeout=60)
    model = llm.bind_tools(tools)
    g = StateGraph(MessagesState)
    g.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("tools", ToolNode(tools))
    g.add_edge(START, "model")
    g.add_conditional_edges("model", tools_condition)
    g.add_edge("tools", "model")
    out = g.compile().invoke({"messages": [("user", "Weather in Oslo?")]})
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool", "ai"]
    assert len(ran) == 1 and f"Sunny in {ran[0]}" in str(out["messages"][-1].content)
