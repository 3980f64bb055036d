"""docker-compose.yml, the Dockerfiles, Prometheus and Grafana files: parsed and cross-checked
against the repository (there is no Docker engine here to try them)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

from fleet import metrics
from tests.paths import ROOT


def load_yaml(rel: str) -> Any:
    return yaml.safe_load((ROOT / rel).read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml("docker-compose.yml")


def exposed_names() -> set[str]:
    """Every sample name the fleet's metric objects can expose."""
    out: set[str] = set()
    for obj in vars(metrics).values():
        if isinstance(obj, Counter):
            out.add(obj._name + "_total")
        elif isinstance(obj, Histogram):
            out |= {obj._name + s for s in ("_bucket", "_sum", "_count")}
        elif isinstance(obj, Gauge):
            out.add(obj._name)
    return out


def bind_mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        out.append((src, dst))
    return out


def test_every_service_builds_or_pulls_and_its_paths_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "gateway", "scaler", "prometheus", "grafana"} <= set(services)
    named_volumes = set(compose.get("volumes") or {})
    networks = set(compose.get("networks") or {})
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            ctx = ROOT / svc["build"].get("context", ".")
            dockerfile = ctx / svc["build"].get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
            check_dockerfile(dockerfile, ctx)
        for src, _ in bind_mounts(svc):
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: mounts {src}, which is not in the repository"
            elif not src.startswith("/"):
                assert src in named_volumes, f"{name}: volume {src} is not declared"
        for net in svc.get("networks", []):
            assert net in networks, f"{name}: network {net} is not declared"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name}: depends on unknown service {dep}"
        if "profiles" in svc:  # build-only entries do not run
            continue
        assert svc.get("restart") in ("unless-stopped", "always"), f"{name}: no restart policy"
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    # Images the scaler starts must be buildable from this compose file.
    scaler_cmd = services["scaler"]["command"]
    worker_image = scaler_cmd[scaler_cmd.index("--image") + 1]
    assert any(s.get("image") == worker_image and "build" in s for s in services.values()), worker_image
    scaler_net = scaler_cmd[scaler_cmd.index("--network") + 1]
    assert scaler_net in {n.get("name", k) for k, n in compose["networks"].items()}
    # A service that uses an image without building it needs another service to build it.
    built = {s["image"] for s in services.values() if "build" in s and "image" in s}
    for name, svc in services.items():
        img = svc.get("image", "")
        if "build" not in svc and img.startswith("fleet-"):
            assert img in built, f"{name}: image {img} is built by no service"


def check_dockerfile(path: Path, ctx: Path) -> None:
    text = path.read_text()
    assert re.search(r"^FROM\s+\S+", text, re.M), f"{path}: no FROM"
    for line in re.findall(r"^COPY\s+(.+)$", text, re.M):
        parts = [p for p in line.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ctx / src).exists(), f"{path.name}: COPY {src}, which is not in the build context"


def test_redis_persists_scaler_drives_docker_on_gpus(compose: dict[str, Any]) -> None:
    s = compose["services"]
    redis_cmd = " ".join(s["redis"]["command"])
    assert "--appendonly yes" in redis_cmd
    assert any(dst == "/data" for _, dst in bind_mounts(s["redis"]))
    scaler = s["scaler"]
    assert ("/var/run/docker.sock", "/var/run/docker.sock") in bind_mounts(scaler)
    assert scaler.get("runtime") == "nvidia"
    assert "--backend" in scaler["command"] and "docker" in scaler["command"]
    for part in ("gateway", "scaler"):
        env = s[part]["environment"]
        assert env["REDIS_URL"].startswith("redis://redis:")
        cfg_dir = next(dst for src, dst in bind_mounts(s[part]) if src == "./configs")
        assert env["FLEET_CONFIG"].startswith(cfg_dir + "/")
        assert (ROOT / "configs" / env["FLEET_CONFIG"][len(cfg_dir) + 1:]).is_file()


def test_prometheus_scrapes_every_part_where_it_listens(compose: dict[str, Any]) -> None:
    prom = load_yaml("configs/prometheus.yml")
    targets = {job["job_name"]: t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    s = compose["services"]
    gw_cmd, sc_cmd = s["gateway"]["command"], s["scaler"]["command"]
    assert targets["fleet-gateway"] == f"gateway:{gw_cmd[gw_cmd.index('--port') + 1]}"
    assert targets["fleet-scaler"] == f"scaler:{sc_cmd[sc_cmd.index('--metrics-port') + 1]}"
    assert sc_cmd[sc_cmd.index("--metrics-host") + 1] == "0.0.0.0"  # reachable from the prometheus container
    prom_mounts = dict(bind_mounts(s["prometheus"]))
    assert prom_mounts["./configs/prometheus.yml"] in " ".join(s["prometheus"]["command"])


def test_grafana_provisioning_and_dashboard(compose: dict[str, Any]) -> None:
    mounts = dict(bind_mounts(compose["services"]["grafana"]))
    ds = load_yaml("configs/grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    provider = load_yaml("configs/grafana/provisioning/dashboards/fleet.yml")["providers"][0]
    assert provider["options"]["path"] == mounts["./configs/grafana/dashboards"]
    assert mounts["./configs/grafana/provisioning"] == "/etc/grafana/provisioning"

    dash = json.loads((ROOT / "configs/grafana/dashboards/fleet.json").read_text())
    assert dash["uid"] and dash["title"]
    tier_var = next(v for v in dash["templating"]["list"] if v["name"] == "tier")
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert rows and rows[0]["repeat"] == "tier"  # one row per tier
    assert tier_var["includeAll"] and tier_var["multi"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    titles = " | ".join(p["title"].lower() for p in panels)
    for must in ("demand vs served", "drain time against threshold", "floor and ceiling", "ttft and tpot",
                 "sheds by reason", "spend vs budget"):
        assert must in titles, must
    known = exposed_names()
    ids = set()
    for p in panels:
        assert p["id"] not in ids
        ids.add(p["id"])
        assert p["datasource"]["uid"] == ds["uid"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == ds["uid"]
            assert '$tier' in t["expr"], (p["title"], t["expr"])
            for name in re.findall(r"\bfleet_[a-z_]+", t["expr"]):
                assert name in known, f"{p['title']}: {name} is not a metric of fleet/metrics.py"


def test_metrics_catalogue_lists_every_metric() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for obj in vars(metrics).values():
        if isinstance(obj, Counter):
            assert f"`{obj._name}_total`" in doc, obj._name
        elif isinstance(obj, Histogram | Gauge):
            assert f"`{obj._name}`" in doc, obj._name


def test_worker_image_runs_the_command_the_scaler_and_compose_give_it(compose: dict[str, Any]) -> None:
    """The container's argv is ENTRYPOINT + command: the scaler passes ["fleet", "worker", ...], so an
    ENTRYPOINT of its own would double it. The fixed worker entry reserves an NVIDIA GPU."""
    from scaler.backends import Supervised, container_spec

    text = (ROOT / "Dockerfile.worker").read_text()
    entry = re.findall(r"^ENTRYPOINT\s+(.+)$", text, re.M)
    entrypoint = json.loads(entry[-1]) if entry else []
    cmd = container_spec("fleet", "fleet-worker:latest", Supervised(id="r1", tier="routing", backend="docker",
                                                                     launched=0), {})["command"]
    argv = entrypoint + cmd
    assert argv[:2] == ["fleet", "worker"] and "worker" not in argv[2:], argv
    # FLEET_CONFIG reaches the scaler's containers without a mount: the image must hold it.
    assert re.search(r"^COPY\s+configs\s", text, re.M)
    worker = compose["services"]["worker"]
    assert worker["image"] == compose["services"]["worker-image"]["image"]
    assert entrypoint + worker["command"][:2] == ["fleet", "worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_the_cpu_override_changes_only_what_a_cpu_box_lacks(compose: dict[str, Any]) -> None:
    """docker-compose.cpu.yml (run for real by tests/containers/test_containers.py): the sim engine, no NVIDIA
    runtime, host networking, local images and ports; the GPU box's file stays as it is."""
    cpu = load_yaml("docker-compose.cpu.yml")
    allowed = {"image", "command", "network_mode", "environment", "healthcheck", "volumes", "runtime", "profiles"}
    for name, svc in cpu["services"].items():
        assert name in compose["services"], name
        assert set(svc) <= allowed, (name, set(svc) - allowed)
    s = cpu["services"]
    assert s["scaler"]["runtime"] == "runc" and "--engine" in s["scaler"]["command"]
    assert s["scaler"]["command"][s["scaler"]["command"].index("--engine") + 1] == "sim"
    assert all(s[p]["network_mode"] == "host" for p in ("redis", "gateway", "scaler"))
    assert "--appendonly" in s["redis"]["command"]
    # Services join compose's default network (named fleet-net) instead of listing one, so host mode can replace it.
    assert not any("networks" in v for v in compose["services"].values())
    assert compose["networks"]["default"]["name"] == "fleet-net"
