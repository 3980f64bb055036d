"""A bad model version in the config names the field (its name, its sim profile, its engine, the
rollout's bounds), read with no Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.config import load_config
from tests.paths import TESTS

CONFIG = TESTS / "fleet-rollout.yaml"
TIER = "routing"


def test_a_bad_version_in_the_config_names_the_field(tmp_path: Path) -> None:
    import yaml

    from fleet.config import ConfigError

    for tier_patch, says in (
        ({"version": "v 1"}, "version name 'v 1'"),
        ({"versions": {"v2": {"sim": {"decode_step": {"base_s": -1}}}}}, "versions.v2.sim"),
        ({"versions": {"v2": {"engine": "gpt"}}}, "tiers.routing.versions.v2.engine"),
        ({"rollout": {"max_ttft_p99_ratio": 0.5}}, "tiers.routing.rollout.max_ttft_p99_ratio"),
    ):
        cfg = yaml.safe_load(CONFIG.read_text())
        cfg["tiers"][TIER].update(tier_patch)
        p = tmp_path / "bad.yaml"
        p.write_text(yaml.safe_dump(cfg))
        with pytest.raises(ConfigError) as e:
            load_config(p)
        assert says in str(e.value), str(e.value)
