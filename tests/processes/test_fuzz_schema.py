"""Property-based fuzzing over the published schema (/openapi.json) with schemathesis: a real
gateway, a real Redis and a sim worker. Every case generated from the request models and headers,
valid ones and deliberately invalid ones (Anthropic's Messages routes too), must get no server error
and, when it is an error, a typed body (`error.type` and `error.message`). Two 5xx are documented
outcomes, not server errors: 503 `redis_unavailable` (529 on the Messages routes) and 504
`deadline_exceeded` when the caller's own deadline (a fuzzed `X-Deadline-Ms` of a few ms, admitted
because its service time fits) passes on the way.

Bounded: FLEET_FUZZ_CASES cases at least (default 1,200), a fixed seed (FLEET_FUZZ_SEED, default
12) so CI runs the same cases, no shrinking (failures are collected with a curl line to replay).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from tests.harness import TEST_CONFIG, Fleet, serving

CASES = int(os.environ.get("FLEET_FUZZ_CASES", "1200"))
SEED = int(os.environ.get("FLEET_FUZZ_SEED", "12"))
# Real names, so valid bodies reach the line and the worker. Only a tier that is served: a call admitted
# to a tier nobody serves waits out its (fuzzed, up to a day) deadline.
MODELS = ["routing", "small"]

# Share of the cases per operation and mode; operations without inputs are called once each.
PLAN = {("POST", "/v1/chat/completions"): 0.38, ("POST", "/v1/completions"): 0.30,
        ("POST", "/v1/responses"): 0.17, ("POST", "/v1/fleet/prewarm"): 0.15,
        ("POST", "/v1/messages"): 0.20, ("POST", "/v1/messages/count_tokens"): 0.06}
# A Responses stream ends with its terminal event, as OpenAI's does, an Anthropic Messages stream with
# message_stop; the completion streams with [DONE].
RESPONSES_ENDS = (b"response.completed", b"response.incomplete", b"response.failed", b"message_stop")


def _fuzz_config(path: Path) -> Path:
    """The test fleet, cut down so a valid call is quick: small max_tokens, short default deadline."""
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    cfg["default_deadline_ms"] = 3000
    for tier in cfg["tiers"].values():
        tier["max_tokens_limit"] = 16
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def fuzz_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with serving(redis_url, config_path=_fuzz_config(tmp_path_factory.mktemp("fuzz") / "fleet.yaml")) as f:
        yield f


def problem(status: int, content: bytes, ctype: str) -> str | None:
    """What is wrong with a response, or None: no 5xx but the documented ones, every error typed,
    every stream ended by [DONE] or its API's terminal event."""
    if status >= 400:
        try:
            err = orjson.loads(content)["error"]
            assert isinstance(err["type"], str) and err["type"]
            assert isinstance(err["message"], str) and err["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError, AssertionError):
            return f"untyped {status} body: {content[:200]!r}"
        # Anthropic's routes say 529 for 503 and name the fleet's error in `code`.
        documented = (status in (503, 529) and err.get("code") == "redis_unavailable") or (
            status == 504 and "deadline_exceeded" in (err.get("type"), err.get("code")))  # the caller's deadline
        if status >= 500 and not documented:
            return f"server error {status}: {err}"
    elif ctype.startswith("text/event-stream") and not content.rstrip().endswith(b"data: [DONE]"):
        last = content.rstrip().rsplit(b"\n\n", 1)[-1]
        if not last.startswith(b"event: ") or last.split(b"\n", 1)[0][7:] not in RESPONSES_ENDS:
            return f"a stream that ends neither with [DONE] nor a Responses terminal event: {content[-200:]!r}"
    return None


def test_fuzz_the_published_schema(fuzz_fleet: Fleet) -> None:
    base = fuzz_fleet.base_url
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    # Schemathesis reads 20 events of a stream by default and cuts the rest; a Responses stream of
    # max_tokens_limit (16) tokens has up to 24, and its end is what `problem` checks.
    schema.config.max_stream_events = 200
    session = requests.Session()
    statuses: Counter[int] = Counter()
    answered: Counter[str] = Counter()  # 200s per path: valid cases of every API reached a worker
    failures: list[str] = []
    unsendable = 0
    t0 = time.monotonic()

    def run(case: Any) -> None:
        nonlocal unsendable
        try:
            resp = case.call(base_url=base, session=session, timeout=30)
        except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, UnicodeError, ValueError):
            unsendable += 1  # the HTTP client refuses to send it: nothing reached the gateway
            return
        statuses[resp.status_code] += 1
        if resp.status_code == 200:
            answered[case.operation.path] += 1
        ctype = (resp.headers.get("content-type") or [""])[0]
        why = problem(resp.status_code, resp.content, ctype)
        if why and len(failures) < 20:
            failures.append(f"{why}\n    {case.as_curl_command()}")

    operations = [r.ok() for r in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= set(PLAN), "the schema lost an operation"
    for op in operations:
        share = PLAN.get((op.method.upper(), op.path))
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if share else [GenerationMode.POSITIVE]
        for mode in modes:
            n = max(1, round(CASES * share / len(modes))) if share else 1
            strategy = op.as_strategy(generation_mode=mode)
            if share and op.path != "/v1/fleet/prewarm" and mode is GenerationMode.POSITIVE:
                strategy = st.tuples(strategy, st.sampled_from([*MODELS, None])).map(_with_model)

            @seed(SEED)
            @settings(max_examples=n, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def fuzz(case: Any) -> None:
                run(case)

            fuzz()

    took = time.monotonic() - t0
    total = sum(statuses.values())
    print(f"\nfuzz: {total} cases in {took:.1f} s ({unsendable} unsendable), statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures)
    assert total >= 1000 if CASES >= 1200 else total > 0, f"only {total} cases reached the gateway"
    assert answered["/v1/messages"] > 0 and answered["/v1/chat/completions"] > 0, dict(answered)
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0  # both kinds ran


def _with_model(pair: tuple[Any, str | None]) -> Any:
    """A generated case whose body names a real tier (or keeps its random model name): without this
    almost every valid body would stop at model_not_found and never reach admission or a worker."""
    case, model = pair
    if model is not None and isinstance(case.body, dict):
        case.body = {**case.body, "model": model}
    return case
