"""The edge's pure parts: durations as people read them, and the app's own header bound under
an ASGI server other than ours (Starlette's test client, on a real Redis)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fleet.config import Priority, load_config
from fleet.policy import ServiceForecast, admit, format_duration
from gateway.app import create_app
from tests.harness import TEST_CONFIG


@pytest.mark.parametrize(("seconds", "shown"), [(0.001, "1 ms"), (0.0004, "0.4 ms"), (0.25, "250 ms"),
                                                (0.9994, "999 ms"), (1.0, "1.00 s"), (2.4, "2.40 s"),
                                                (270, "4.5 min"), (21600, "6 h"), (float("inf"), "unbounded")])
def test_durations_read_as_people_read_them(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


def test_a_one_ms_deadline_is_not_zero_seconds_in_the_refusal() -> None:
    d = admit(Priority.interactive, ahead=0, forecast=ServiceForecast(rate=10.0, delay_s=0.0, basis="measured"),
              service_s=0.019, wait_limit_s=10.0, deadline_s=0.001)
    assert not d.admitted and d.reason == "deadline_unmeetable"
    assert "deadline of 1 ms" in d.message and "19 ms" in d.message and "0.00 s" not in d.message


def test_the_app_bounds_headers_itself_under_any_server(redis_url: str) -> None:
    cfg = load_config(TEST_CONFIG)
    with TestClient(create_app(cfg, redis_url)) as c:
        r = c.get("/healthz", headers={"x-padding": "p" * cfg.gateway.max_header_bytes})
        assert r.status_code == 431
        assert r.json()["error"]["code"] == "request_header_fields_too_large"
        assert c.get("/healthz").status_code == 200
        # The framework's own errors are typed here too.
        r = c.post("/v1/models")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
