"""A supervisor backend that starts nothing, for tests of the scaler's decisions (what it orders,
not what a process does)."""

from __future__ import annotations

from scaler.backends import Supervised


class NoLaunch:
    """A backend that starts nothing (the scaler's decisions are what is under test)."""

    name = "none"

    def launch(self, rec: Supervised) -> None: ...

    def alive(self, rec: Supervised) -> bool:
        return True

    def terminate(self, rec: Supervised) -> None: ...

    def kill(self, rec: Supervised) -> None: ...

    def cleanup(self, rec: Supervised) -> None: ...

    def adopt(self, rec: Supervised) -> bool:
        return False

    def discover(self, namespace: str) -> list[Supervised]:
        return []
