"""The Responses API's store bounds in the config: a bad bound names its field, read with no Redis.
The store itself, through gateways: tests/processes/test_responses_store.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleet.config import ConfigError, load_config


@pytest.mark.parametrize(("section", "field"), [({"ttl_s": 0}, "responses.ttl_s"),
                                                ({"max_response_bytes": 10, "max_conversation_bytes": 5},
                                                 "max_conversation_bytes")])
def test_a_bad_bound_names_the_field(tmp_path: Path, section: dict[str, int], field: str) -> None:
    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump({"tiers": {"routing": {}}, "responses": section}))
    with pytest.raises(ConfigError, match=field):
        load_config(p)
