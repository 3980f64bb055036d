"""Redis key names. Every key of a tier shares the hash tag `{tier}`, so a
tier's Lua scripts touch one slot and the protocol runs on Redis Cluster."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierKeys:
    namespace: str
    tier: str

    def _k(self, name: str) -> str:
        return f"{self.namespace}:{{{self.tier}}}:{name}"

    @property
    def line(self) -> str:
        """ZSET request id -> class rank * CLASS_SPAN + arrival sequence."""
        return self._k("line")

    @property
    def inflight(self) -> str:
        """ZSET request id -> lease expiry (Redis clock, ms)."""
        return self._k("inflight")

    @property
    def seq(self) -> str:
        return self._k("seq")

    @property
    def bell(self) -> str:
        """LIST of wake-up tokens: Lua cannot block, so idle workers BLPOP here."""
        return self._k("bell")

    @property
    def counters(self) -> str:
        """HASH accepted / completed / expired / cancelled / failed and token totals."""
        return self._k("counters")

    @property
    def arrivals(self) -> str:
        """ZSET of recent admissions (member id, score ms) for the arrival rate."""
        return self._k("arrivals")

    @property
    def completions(self) -> str:
        """ZSET of recent completions (member id, score ms) for the service rate."""
        return self._k("completions")

    @property
    def replicas(self) -> str:
        """HASH replica id -> heartbeat JSON."""
        return self._k("replicas")

    @property
    def cancel_channel(self) -> str:
        return self._k("cancel")

    @property
    def dead(self) -> str:
        """LIST of requests that failed too many attempts (poison), for an operator."""
        return self._k("dead")

    @property
    def budget(self) -> str:
        """HASH of the tier's budget state as the governor last judged it:
        `exhausted` ("1" or "0"), `retry_at` (epoch seconds when the window
        resets), `window` (its name), `spent`, `projected`, `budget` (dollars).
        The gateway's admission reads it; the budget governor writes it."""
        return self._k("budget")

    def request(self, rid: str) -> str:
        """HASH of one request: payload, class, deadline, state, owner, attempt."""
        return self._k(f"req:{rid}")

    def result(self, rid: str) -> str:
        """STREAM of one request's events: tokens, then done or error."""
        return self._k(f"res:{rid}")
