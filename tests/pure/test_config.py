"""A bad config stops start-up with a message naming the field, never a traceback: the fields, the
classes, the environment's overrides and the warnings, read with no Redis. The command's own exit
on a bad config: tests/processes/test_config.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.config import ConfigError, Priority, load_config
from tests.harness import ROOT, TEST_CONFIG

GOOD = TEST_CONFIG.read_text()


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.yaml"
    p.write_text(text)
    return p


def test_default_config_has_the_three_tiers_and_four_classes() -> None:
    cfg = load_config(ROOT / "configs" / "fleet.yaml")
    assert list(cfg.tiers) == ["routing", "analysis", "planner"]
    assert [p.name for p in Priority] == ["committed", "interactive", "speculative", "background"]
    for tc in cfg.tiers.values():
        assert tc.aliases and tc.warm_floor >= 1 and tc.max_replicas >= tc.warm_floor and tc.slots > 0
        assert tc.sim.weights_gb > 0 and tc.sim.kv_capacity_tokens > 0
    assert cfg.resolve_model("large") == "planner" and cfg.resolve_model("gpt-4") is None


@pytest.mark.parametrize(("edit", "field"), [
    (("weights_gb: 0.2", "weights_gb: -3"), "tiers.routing.sim.weights_gb"),
    (("slots: 4\n", "slots: many\n"), "tiers.routing.slots"),
    (("warm_floor: 1\n    max_replicas: 4\n    drain", "warm_floor: 9\n    max_replicas: 4\n    drain"),
     "tiers.routing"),
    (("lease_s: 1.0", "lease_s: 1.0\n    leese_s: 2"), "tiers.routing.leese_s"),
    (("decode_step: {base_s: 0.002", "decode_step: {base: 0.002"), "tiers.routing.sim.decode_step.base"),
])
def test_bad_field_is_named(tmp_path: Path, edit: tuple[str, str], field: str) -> None:
    old, new = edit
    assert old in GOOD
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, GOOD.replace(old, new, 1)))
    assert field in str(e.value)


def test_unknown_class_in_wait_limits_is_named(tmp_path: Path) -> None:
    text = GOOD.replace("    drain_threshold_s: 2.0", "    drain_threshold_s: 2.0\n    wait_limit_s: {urgent: 3}", 1)
    with pytest.raises(ConfigError, match=r"tiers\.routing\.wait_limit_s.*urgent"):
        load_config(_write(tmp_path, text))


def test_environment_overrides_a_nested_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_TIERS__ROUTING__SLOTS", "11")
    cfg = load_config(TEST_CONFIG)
    assert cfg.tiers["routing"].slots == 11
    assert cfg.tiers["routing"].sim.weights_gb == 0.2  # the rest of the file still applies
    monkeypatch.setenv("FLEET_TIERS__ROUTING__SLOTS", "zero")
    with pytest.raises(ConfigError, match=r"tiers\.routing\.slots"):
        load_config(TEST_CONFIG)


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "tiers: [unclosed"))


def test_a_higher_class_with_a_tighter_wait_limit_is_warned_about(tmp_path: Path) -> None:
    import warnings

    from fleet.config import ConfigWarning, wait_limit_inversions

    # The shipped defaults shed from the bottom: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(ROOT / "configs" / "fleet.yaml")
    assert wait_limit_inversions({"committed": 30, "interactive": 4, "speculative": 4, "background": 4}) == []
    inverted = "    wait_limit_s: {committed: 2, interactive: 8, background: 30}"
    text = GOOD.replace("    drain_threshold_s: 2.0", "    drain_threshold_s: 2.0\n" + inverted, 1)
    with pytest.warns(ConfigWarning) as said:
        load_config(_write(tmp_path, text))
    # Each inversion is named, with its field: committed under both, interactive under background.
    assert sorted(str(w.message).split(":")[1].strip() for w in said) == [
        "committed (2 s) is tighter than background (30 s)",
        "committed (2 s) is tighter than interactive (8 s)",
        "interactive (8 s) is tighter than background (30 s)"]
    assert all(str(w.message).startswith("tiers.routing.wait_limit_s:") for w in said)


@pytest.mark.parametrize(("keys", "named"), [
    ("[{name: a, sha256: " + "a" * 64 + ", tiers: [nosuchtier]}]", "keys.0.tiers"),
    ("[{name: a, sha256: " + "a" * 64 + ", max_priority: urgent}]", "keys.0.max_priority"),
    ("[{name: a, sha256: " + "a" * 64 + "}, {name: a, sha256: " + "b" * 64 + "}]", "keys.1.name"),
])
def test_a_bad_key_is_named(tmp_path: Path, keys: str, named: str) -> None:
    """The same checks `fleet keys add` runs (issue 12): a tier that exists, a class, a unique name."""
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, GOOD + f"keys: {keys}\n"))
    assert named in str(e.value), str(e.value)
