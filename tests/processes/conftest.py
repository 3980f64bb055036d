"""Fixtures the process tests of one config share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Fleet, scaled_fleet, serving
from tests.scaler_harness import SCALER_CONFIG, TIER

CLOCK_CONFIG = Path(__file__).resolve().parent.parent / "fleet-clock.yaml"


@pytest.fixture(scope="module")
def clock_fleet(redis_url: str) -> Iterator[Fleet]:
    """The client-clock fleet (tests/fleet-clock.yaml): its `slow` tier, 10 ms a token, up and ready."""
    with serving(redis_url, ("slow",), config_path=CLOCK_CONFIG) as f:
        yield f


@pytest.fixture
def sfleet(store_url: str) -> Iterator[Fleet]:
    with scaled_fleet(store_url, SCALER_CONFIG, TIER) as f:
        yield f
