"""The fleet in containers on a real Docker Engine: docker-compose.yml with the CPU override, the
scaler starting, replacing, adopting and stopping worker containers through its docker backend.

One stack for the module (its start costs a minute on a vfs daemon); the tests run in file order
and leave it as they found it: three worker containers, one per tier at its warm floor. The last
test takes it down and checks that nothing is left.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis

from fleet.config import Priority
from fleet.redis_server import free_port
from fleet.store.line import Line
from tests.docker_stack import LABEL, ROOT, Stack, compose, start_stack
from tests.harness import call_payload, wait_until

pytestmark = pytest.mark.timeout(900)  # the first test pays for a cold image build (about 4 minutes)
TIERS = {"routing": "fleet-small", "analysis": "fleet-mid", "planner": "fleet-large"}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # Under the checkout, not /tmp/pytest-of-root: the worker containers run as uid 1000 and read it.
    tmp = ROOT / ".docker" / f"stack-{uuid.uuid4().hex[:8]}"
    s = start_stack(tmp)
    try:
        yield s
    finally:
        s.down()
        shutil.rmtree(tmp, ignore_errors=True)


def at_floors(s: Stack) -> bool:
    return all(len(s.workers(t)) == 1 and len(s.ready(t)) == 1 for t in TIERS)


def client(s: Stack) -> openai.OpenAI:
    """The `openai` client with the admin key the gateway made on its first start."""
    assert s.admin_key, "the gateway printed no admin key on its first start"
    return openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=s.admin_key, timeout=90, max_retries=0)


def enqueue(s: Stack, tier: str, n: int, max_tokens: int = 10) -> list[str]:
    """n completions straight onto the tier's line (as the gateway would), without waiting for them."""
    rids = [uuid.uuid4().hex for _ in range(n)]

    async def go() -> None:
        r = Redis.from_url(s.redis_url)
        line = Line(r, s.namespace, tier, rate_window_s=4.0)
        payload = call_payload(max_tokens=max_tokens)
        await asyncio.gather(*(line.enqueue(rid, Priority.interactive, payload, 120_000) for rid in rids))
        await r.aclose()

    asyncio.run(go())
    return rids


def test_each_tier_is_served_by_worker_containers_through_the_openai_client(stack: Stack) -> None:
    s = stack
    wait_until(lambda: at_floors(s), 180, interval=0.5, what="one ready worker container per tier")
    c = client(s)
    for tier, model in TIERS.items():
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hello {tier}"}],
                                      max_tokens=6)
        assert r.choices[0].message.content and r.usage.completion_tokens == 6, r
        # The replica that served it is a container the scaler started, labelled for this fleet.
        (rid,) = s.ready(tier)
        labels = s.workers(tier)[rid]["Labels"]
        assert labels[f"{LABEL}.tier"] == tier and labels[f"{LABEL}.namespace"] == s.namespace
        assert labels[f"{LABEL}.version"] and labels[f"{LABEL}.image"] == "fleet-gateway:latest"
    chunks = list(c.chat.completions.create(model="fleet-small", messages=[{"role": "user", "content": "stream"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError):  # a typed error, from the gateway in its container
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


def test_the_admin_key_made_on_first_start_works_and_nothing_works_without_a_key(stack: Stack) -> None:
    """The gateway made an admin key on its first start (only its sha256 in Redis): it steers the
    fleet; without a key nothing does, calls included."""
    s = stack
    stored = {k.decode(): json.loads(v) for k, v in s.r.hgetall(f"{s.namespace}:apikeys").items()}
    assert [(v["name"], v["admin"]) for v in stored.values()] == [("admin", True)]
    assert s.admin_key and s.admin_key not in json.dumps(stored)  # the digest, never the secret
    body = {"tier": "routing", "floor": 1, "duration_s": 60}
    anon = httpx.post(f"{s.base_url}/v1/fleet/prewarm", json=body, timeout=10)
    assert anon.status_code == 401 and anon.json()["error"]["code"] == "invalid_api_key", anon.text
    ok = httpx.post(f"{s.base_url}/v1/fleet/prewarm", json=body, timeout=10,
                    headers={"authorization": f"Bearer {s.admin_key}"})
    assert ok.status_code == 200 and ok.json()["by"] == "admin", ok.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="fleet-small", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    # A restarted gateway finds the key and makes no other.
    s.compose("restart", "gateway")
    compose.wait_ready(s.env)
    assert len(s.r.hgetall(f"{s.namespace}:apikeys")) == 1
    assert client(s).chat.completions.create(model="fleet-small", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=2).usage.completion_tokens == 2


def test_prometheus_discovers_the_worker_containers_and_the_dashboard_queries_answer(stack: Stack,
                                                                                    tmp_path: Path) -> None:
    """A real Prometheus (Debian's) on configs/prometheus.cpu.yml, with this stack's ports, socket and
    namespace: Docker service discovery finds each worker container the scaler started, and every
    query of the Grafana dashboard is accepted (Grafana itself cannot be installed here: its
    rendering is not checked)."""
    s = stack
    wait_until(lambda: at_floors(s), 120, interval=0.5, what="the floors")
    text = (ROOT / "configs/prometheus.cpu.yml").read_text()
    text = (text.replace("127.0.0.1:9100", f"127.0.0.1:{s.env['FLEET_GATEWAY_METRICS_PORT']}")
            .replace("127.0.0.1:9101", f"127.0.0.1:{s.env['FLEET_SCALER_METRICS_PORT']}")
            .replace("unix:///var/run/docker.sock", s.host)
            .replace("fleet.replica.namespace=fleet", f"fleet.replica.namespace={s.namespace}"))
    (tmp_path / "prometheus.yml").write_text(text)
    port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        def workers_up() -> list[dict[str, Any]]:
            try:
                active = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError):
                return []
            return [t for t in active if t["labels"]["job"] == "fleet-workers" and t["health"] == "up"]

        wait_until(lambda: len(workers_up()) == len(TIERS), 90, interval=1, what="three worker targets up")
        found = {t["labels"]["tier"]: t["labels"]["replica"] for t in workers_up()}
        assert found == {t: next(iter(s.workers(t))) for t in TIERS}
        wait_until(lambda: _query(api, 'fleet_replicas{tier="routing",state="ready"}'), 60, interval=1,
                   what="the gateway's replica gauge scraped")
        dash = json.loads((ROOT / "configs/grafana/dashboards/fleet.json").read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        assert exprs
        for e in exprs:
            q = e.replace("$tier", "routing").replace("$__rate_interval", "1m").replace("$__interval", "15s")
            r = httpx.get(f"{api}/query", params={"query": q}, timeout=10).json()
            assert r["status"] == "success", (e, r)
    finally:
        prom.terminate()
        prom.wait(30)


def _query(api: str, q: str) -> list[Any]:
    try:
        return list(httpx.get(f"{api}/query", params={"query": q}, timeout=5).json()["data"]["result"])
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def test_a_burst_grows_the_worker_containers_and_quiet_brings_them_back_to_the_floor(stack: Stack) -> None:
    s = stack
    wait_until(lambda: at_floors(s), 120, interval=0.5, what="the floors")
    before = set(s.workers("routing"))
    t0 = time.time()
    enqueue(s, "routing", 40)  # ~10 s of work for one replica at ~4 requests/s: drain far over 2 s
    done0 = s.counters("routing").get("completed", 0)
    peak = 1
    while s.counters("routing").get("completed", 0) - done0 < 40:
        assert time.time() - t0 < 180, "the burst was not served within 180 s"
        peak = max(peak, len(s.workers("routing", all_states=True)))  # created ones too: a vfs start is slow
        time.sleep(0.5)
    assert peak >= 2, "no worker container was added under the burst"
    c = s.counters("routing")
    assert c.get("failed", 0) == 0 and c.get("expired", 0) == 0
    # Quiet: back to one container, the one that was there before (the youngest go first).
    wait_until(lambda: len(s.workers("routing", all_states=True)) == 1, 120, interval=0.5,
               what="routing back to one worker container")
    assert set(s.workers("routing")) == before
    outs = [e for e in s.decisions("routing", t0) if e.get("action") == "scale_out"]
    ins = [e for e in s.decisions("routing", t0) if e.get("action") == "scale_in"]
    started = sum(int(e["delta"]) for e in outs)
    assert outs and started == -sum(int(e["delta"]) for e in ins), (outs, ins)  # every one added went again
    assert 2 <= peak <= 1 + started <= 4  # within the ceiling (max_replicas 4)


def test_a_killed_worker_container_is_replaced_and_its_request_completes_once(stack: Stack) -> None:
    s = stack
    wait_until(lambda: at_floors(s), 120, interval=0.5, what="the floors")
    (victim,) = s.workers("routing")
    before = s.counters("routing")
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["r"] = client(s).chat.completions.create(
                model="fleet-small", messages=[{"role": "user", "content": "long"}], max_tokens=60,
                extra_body={"ignore_eos": True})  # ~3 s of decode, every token of it
        except Exception as e:  # reported by the assertion below
            out["e"] = e

    th = threading.Thread(target=call)
    th.start()
    wait_until(lambda: s.r.zcard(s.keys("routing").inflight) == 1, 30, interval=0.05, what="the call in flight")
    s.client.api.kill(s.workers("routing")[victim]["Id"])  # docker kill: SIGKILL, no drain
    th.join(150)
    assert not th.is_alive() and "e" not in out, out
    assert out["r"].usage.completion_tokens == 60
    after = s.counters("routing")
    assert after.get("requeued", 0) - before.get("requeued", 0) == 1  # the lease expired; back on the line
    assert after.get("completed", 0) - before.get("completed", 0) == 1  # and completed exactly once
    wait_until(lambda: len(s.ready("routing")) == 1 and victim not in s.workers("routing", all_states=True), 120,
               interval=0.5, what="a replacement container ready and the killed one removed")
    assert any(e.get("event") == "died" and e.get("replica") == victim for e in s.decisions("routing"))


def test_a_restarted_scaler_adopts_the_running_worker_containers(stack: Stack) -> None:
    s = stack
    wait_until(lambda: at_floors(s), 120, interval=0.5, what="the floors")
    running = {t: set(s.workers(t)) for t in TIERS}
    t0 = time.time()
    s.compose("stop", "-t", "30", "scaler")
    # One tier's records lost as well (as if Redis had lost them): its container's labels alone must
    # let the new scaler find it (the backend's discovery), the others' records name theirs (adoption).
    s.r.delete(s.keys("analysis").supervised)
    s.compose("start", "scaler")
    # The new scaler holds the lease and decides (its ticks are published) ...
    wait_until(lambda: all(float(s.r.hget(s.keys(t).scaler, "ts") or 0) > t0 + 3 for t in TIERS), 90,
               interval=0.5, what="the restarted scaler deciding for every tier")
    # ... and started nothing: the same containers, no scale-out since the restart.
    assert {t: set(s.workers(t, all_states=True)) for t in TIERS} == running
    assert not [e for t in TIERS for e in s.decisions(t, t0) if e.get("action") == "scale_out"]
    (found,) = running["analysis"]
    assert s.r.hexists(s.keys("analysis").supervised, found)  # discovered by its labels and recorded again
    assert client(s).completions.create(model="fleet-mid", prompt="after restart", max_tokens=3).usage


def test_queued_work_survives_a_redis_restart_and_the_parts_reconnect(stack: Stack) -> None:
    s = stack
    wait_until(lambda: at_floors(s), 120, interval=0.5, what="the floors")
    # Hold the line still: no scaler, and the planner's worker drained away, so what is queued stays queued.
    s.compose("stop", "-t", "30", "scaler")
    for c in s.workers("planner").values():
        s.client.api.stop(c["Id"], timeout=30)
    enqueue(s, "planner", 5, max_tokens=4)
    k = s.keys("planner")
    assert s.r.zcard(k.line) == 5
    s.compose("restart", "-t", "10", "redis")
    wait_until(lambda: _ping(s), 60, interval=0.5, what="redis back")
    assert s.r.zcard(k.line) == 5  # AOF: the queued work came back with Redis
    s.compose("start", "scaler")
    wait_until(lambda: s.counters("planner").get("completed", 0) >= 5 and s.r.zcard(k.line) == 0, 180,
               interval=0.5, what="the queued work served after the restart")
    # The gateway and the other tiers' workers reconnected on their own.
    wait_until(lambda: at_floors(s), 120, interval=0.5, what="every tier at its floor again")
    assert client(s).chat.completions.create(model="fleet-small", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3).usage.completion_tokens == 3


def _ping(s: Stack) -> bool:
    try:
        return bool(s.r.ping())
    except Exception:
        return False


def test_compose_down_leaves_no_worker_container(stack: Stack) -> None:
    s = stack
    assert s.workers()  # there were some
    s.down()
    assert not s.workers(all_states=True)
    assert not s.client.containers.list(all=True, filters={"label": f"com.docker.compose.project={s.project}"})
