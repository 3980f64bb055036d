"""Cold starts by phase, live: a sim worker process reports load, init and first_token; they reach its
heartbeat, its metrics port, the gateway's status (beside the model, with the model's error) and the
gateway's metrics, and they add up to the cold start the replica measured."""

from __future__ import annotations

import subprocess
import sys

import httpx
import orjson

from fleet.policy.cold_start import PHASES
from fleet.redis_server import free_port
from tests.harness import ROOT, Fleet, wait_until
from tests.processes.test_metrics import scrape, value

TOLERANCE_S = 0.02  # the phases are timed back to back: only the loop between them is left out


def test_sim_cold_start_phases_in_metrics_and_status(fleet: Fleet) -> None:
    fleet.start_gateway()
    port = free_port()
    rid = fleet.start_worker("routing", "routing-cs1", metrics_port=str(port))
    beat = orjson.loads(fleet.r.hget(fleet.keys("routing").replicas, rid))
    phases = beat["cold_start_phases"]
    assert phases is not None
    assert all(phases[f"{p}_s"] > 0 for p in PHASES), phases
    parts = sum(phases[f"{p}_s"] for p in PHASES)
    assert abs(parts - beat["cold_start_s"]) <= TOLERANCE_S, (phases, beat["cold_start_s"])

    # The replica's own histogram: one observation a phase, of what it measured.
    worker = scrape(f"http://127.0.0.1:{port}/metrics")
    for p in PHASES:
        assert value(worker, "fleet_cold_start_phase_seconds_count", tier="routing", phase=p) == 1
        assert (
            abs(value(worker, "fleet_cold_start_phase_seconds_sum", tier="routing", phase=p) - phases[f"{p}_s"]) < 1e-3
        )

    # The status page: the replica's phases, the median beside the model, and the model's error.
    tier = httpx.get(f"{fleet.base_url}/v1/fleet/status", timeout=10).json()["tiers"]["routing"]
    detail = next(r for r in tier["replica_detail"] if r["id"] == rid)
    assert detail["cold_start_phases"]["load_s"] == phases["load_s"]
    cs = tier["cold_start"]
    assert cs["replicas"] == 1
    tc = fleet.cfg.tiers["routing"]
    assert abs(cs["modelled"]["load_s"] - tc.sim.weights_gb / tc.sim.load_gb_s) < 1e-9
    assert cs["modelled"]["warmup_s"] == tc.sim.warmup_s
    errors = {e["term"]: e for e in cs["error"]}
    assert set(errors) == {"load", "warmup", "total"}
    total = errors["total"]
    assert abs(total["error_s"] - (beat["cold_start_s"] - cs["modelled"]["total_s"])) < 1e-3
    # The sim sleeps what its profile says: the model is right, to a loaded box's oversleep.
    assert -TOLERANCE_S <= total["error_s"] < 0.5, total

    # The gateway's gauge of the model's error, from the same heartbeats.
    def gauge_set() -> bool:
        return bool(
            [
                v
                for lab, v in scrape(f"{fleet.base_url}/metrics").get("fleet_cold_start_model_error_seconds", [])
                if lab.get("tier") == "routing"
            ]
        )

    wait_until(gauge_set, 10, what="model error gauge")
    gw = scrape(f"{fleet.base_url}/metrics")
    assert (
        abs(value(gw, "fleet_cold_start_model_error_seconds", tier="routing", term="total") - total["error_s"]) < 1e-3
    )

    # `fleet status`: a line under the table with the phases, the model and its error.
    out = subprocess.run(
        [sys.executable, "-m", "fleetctl", "status", "--url", fleet.base_url],
        env={**fleet.env, "COLUMNS": "200"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("routing: cold start"))
    assert "median of 1" in line and "first token" in line and "model 0.20s" in line and "error" in line, line
