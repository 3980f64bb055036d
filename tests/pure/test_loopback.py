"""Which listening addresses reach beyond loopback (`gateway.auth.beyond_loopback`), and a gateway
exposed beyond it with no API key warns that calls are refused with 401. No Redis, no process:
the gateways bound to 0.0.0.0 are tested in tests/processes/test_auth_exposed.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from fleet.config import load_config
from gateway.auth import beyond_loopback
from gateway.server import expose
from tests.harness import TEST_CONFIG


def test_which_addresses_reach_beyond_loopback(caplog: pytest.LogCaptureFixture) -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert not beyond_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "no-such-host.invalid"):
        assert beyond_loopback(host), host

    app = SimpleNamespace(state=SimpleNamespace())  # what expose() touches of a FastAPI app
    with caplog.at_level(logging.WARNING, logger="fleet.gateway.server"):
        expose(app, load_config(TEST_CONFIG), "0.0.0.0")
    assert app.state.exposure.beyond_loopback and not app.state.exposure.open
    assert "refused with 401" in caplog.text
