"""Real agent frameworks from PyPI run their tool loops through the fleet, streamed and not.

Four frameworks, each pointed at the gateway's base URL as its docs say: the OpenAI Agents SDK
(its Chat Completions model), LangGraph (a ReAct agent over LangChain's ChatOpenAI), PydanticAI
and Instructor. Each runs on the `sim` engine (`routing`) and on the `openai` engine in front of a
scripted upstream that answers as OpenAI does (`analysis`, tests/agent_upstream.py). A loop is
whole when the tool ran with the arguments the model made and the final answer quotes its
result, which only happens if the tool call and the tool's result both crossed the fleet intact.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import instructor
import openai
import pytest
from pydantic import BaseModel

from tests.agent_upstream import Upstream, agent_fleet
from tests.harness import Fleet

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # the Agents SDK would export traces to OpenAI

TIERS = ["routing", "analysis"]  # sim; openai in front of the scripted upstream
RAN: list[str] = []  # the cities the tools were called with


def weather(city: str) -> str:
    """The weather in a city."""
    RAN.append(city)
    return f"sunny in {city}"


class Forecast(BaseModel):
    city: str
    celsius: int
    windy: bool


@pytest.fixture(scope="module")
def agents(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Upstream]]:
    with agent_fleet(redis_url, tmp_path_factory.mktemp("frameworks")) as fleet_and_upstream:
        yield fleet_and_upstream


def base_url(f: Fleet) -> str:
    return f"{f.base_url}/v1"


def ran_and_quoted(answer: str) -> None:
    assert RAN, "the tool never ran"
    assert f"sunny in {RAN[-1]}" in answer, answer


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tier", TIERS)
async def test_openai_agents_sdk(agents: tuple[Fleet, Upstream], tier: str, stream: bool) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    f, _ = agents
    model = OpenAIChatCompletionsModel(model=tier, openai_client=openai.AsyncOpenAI(
        base_url=base_url(f), api_key="unused", max_retries=0, default_headers={"X-Chain-Id": "sdk-loop"}))
    agent = Agent(name="forecaster", instructions="Use the tool.", tools=[function_tool(weather)], model=model)
    RAN.clear()
    if stream:
        result = Runner.run_streamed(agent, "Weather in Oslo?")
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, "Weather in Oslo?")
    ran_and_quoted(str(result.final_output))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tier", TIERS)
def test_langgraph_react_agent(agents: tuple[Fleet, Upstream], tier: str, stream: bool) -> None:
    """LangGraph's ReAct loop as its docs build it: a model node, a ToolNode, and tools_condition between."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    f, _ = agents
    tools = [tool(weather)]
    llm = ChatOpenAI(model=tier, base_url=base_url(f), api_key="unused", streaming=stream, max_retries=0)  # type: ignore[arg-type]
    model = llm.bind_tools(tools)
    g = StateGraph(MessagesState)
    g.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("tools", ToolNode(tools))
    g.add_edge(START, "model")
    g.add_conditional_edges("model", tools_condition)
    g.add_edge("tools", "model")
    graph = g.compile()
    RAN.clear()
    out = graph.invoke({"messages": [("user", "Weather in Oslo?")]})
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool", "ai"]
    ran_and_quoted(str(out["messages"][-1].content))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tier", TIERS)
async def test_pydantic_ai_agent(agents: tuple[Fleet, Upstream], tier: str, stream: bool) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    f, _ = agents
    model = OpenAIChatModel(tier, provider=OpenAIProvider(base_url=base_url(f), api_key="unused"))
    agent = Agent(model, instructions="Use the tool.", tools=[weather])
    RAN.clear()
    if stream:
        async with agent.run_stream("Weather in Oslo?") as run:
            answer = await run.get_output()
    else:
        answer = (await agent.run("Weather in Oslo?")).output
    ran_and_quoted(str(answer))
    # Structured output, which PydanticAI asks for as a tool call of its own.
    forecast = (await Agent(model, output_type=Forecast).run("Forecast for Oslo")).output
    assert isinstance(forecast, Forecast)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
@pytest.mark.parametrize("tier", TIERS)
def test_instructor_structured_output(agents: tuple[Fleet, Upstream], tier: str, mode: instructor.Mode) -> None:
    f, up = agents
    client = instructor.from_openai(openai.OpenAI(base_url=base_url(f), api_key="unused", max_retries=0), mode=mode)
    ask = [{"role": "user", "content": "Forecast for Oslo"}]
    forecast = client.chat.completions.create(model=tier, response_model=Forecast, messages=ask, max_retries=0)  # type: ignore[arg-type]
    assert isinstance(forecast, Forecast)
    if tier == "analysis":  # the upstream's script fills each field by its type
        assert forecast.model_dump() == {"city": "Oslo", "celsius": 7, "windy": False}
        sent = up.seen[-1][1]
        assert ("tools" in sent) == (mode == instructor.Mode.TOOLS)
        assert ("response_format" in sent) == (mode == instructor.Mode.JSON_SCHEMA)
    partials = list(client.chat.completions.create_partial(model=tier, response_model=Forecast, messages=ask,  # type: ignore[arg-type]
                                                           max_retries=0))
    assert partials and partials[-1].model_dump() == forecast.model_dump()  # streamed, merged to the same
