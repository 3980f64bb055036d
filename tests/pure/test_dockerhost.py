"""scripts/dockerhost.py's choices that need no daemon: where the base image's root filesystem is
made on a machine whose data root was never made (a user's own daemon, a fresh machine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import dockerhost


def test_the_scratch_folder_is_made_in_a_data_root_that_does_not_exist(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = tmp_path / "never-made"
    monkeypatch.setattr(dockerhost, "STATE", fresh)
    if os.geteuid() != 0:  # debootstrap chroots: a user who is not root is told how to run it
        with pytest.raises(SystemExit, match="needs root"):
            dockerhost.scratch_dir()
        return
    d = dockerhost.scratch_dir()
    assert d == fresh / "tmp" and d.is_dir()  # once a FileNotFoundError when the root was missing

