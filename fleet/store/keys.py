"""Redis key names, one per key family. Every key of a tier shares the hash tag `{tier}`, so a
tier's Lua scripts touch one slot and the protocol runs on Redis Cluster.

Each family has one module in `fleet.store` that defines its record, its writer
and its reader; the docstring of each name says which.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierKeys:
    namespace: str
    tier: str

    def _k(self, name: str) -> str:
        return f"{self.namespace}:{{{self.tier}}}:{name}"

    @property
    def prefix(self) -> str:
        """What every key of the tier starts with: the line's scripts build a call's keys from it
        with helpers generated from the methods below (`fleet.store.lua.KEY_HELPERS`)."""
        return self._k("")

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

    def wake(self, replica: str) -> str:
        """LIST: a replica's own wake-up token, pushed to end its wait on the bell early (a drain)."""
        return self._k(f"wake:{replica}")

    @property
    def affinity(self) -> str:
        """HASH prefix key -> the replica that claimed a call of it last; `affinity_at` ZSET prefix
        key -> when; `affinity_count` HASH replica -> prefixes it holds; `claimers` ZSET replica ->
        its last claim (ms). Written by the affine claim, read by it and the scaler (`fleet.store.affinity`)."""
        return self._k("aff")

    @property
    def affinity_at(self) -> str:
        return self._k("aff:at")

    @property
    def affinity_count(self) -> str:
        return self._k("aff:n")

    @property
    def claimers(self) -> str:
        return self._k("claimers")

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
        """HASH replica id -> heartbeat JSON (`fleet.store.heartbeats`)."""
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
        """HASH of the tier's budget judgement as the governor last published it, with a
        TTL (`fleet.store.tier_budget`)."""
        return self._k("budget")

    @property
    def capacity(self) -> str:
        """HASH of the tier's calibrated capacity as the scaler last published it, for the
        gateways' admission (`fleet.store.capacity`)."""
        return self._k("capacity")

    @property
    def admitting(self) -> str:
        """ZSET "rank:request id" -> expiry (Redis clock, ms) of requests admitted but
        not yet in the line, so that a burst of concurrent admissions sees each other
        (`fleet.store.admitting`)."""
        return self._k("admitting")

    @property
    def prewarm(self) -> str:
        """HASH order id -> JSON {floor, until, created}: operator pre-warms
        (POST /v1/fleet/prewarm, `fleet prewarm`); the scaler prunes expired ones
        (`fleet.store.prewarm_orders`)."""
        return self._k("prewarm")

    @property
    def scaler(self) -> str:
        """HASH of what the scaler last decided for the tier (`fleet.store.scaler_state`)."""
        return self._k("scaler")

    @property
    def decisions(self) -> str:
        """STREAM (capped) of scaling decisions and replica events with their reasons, for
        operators (`fleet.store.scaler_state`)."""
        return self._k("decisions")

    @property
    def supervised(self) -> str:
        """HASH replica id -> JSON of how the supervisor started it (backend, pid or
        container, host, GPUs, launch time), so the next leader can re-find it."""
        return self._k("supervised")

    @property
    def ledger_beats(self) -> str:
        """HASH replica id -> "ms|state|started ms": where each replica's cost was last accrued
        to, so every replica-second is counted once, whoever reports it."""
        return self._k("ledger:beats")

    @property
    def ledger_total(self) -> str:
        """HASH of lifetime spend totals (see `fleet.store.ledger`)."""
        return self._k("ledger:total")

    def ledger_day(self, day: int) -> str:
        """HASH of one UTC day's spend, by minute, hour and day (see `fleet.store.ledger`)."""
        return self._k(f"ledger:d:{day}")

    @property
    def models(self) -> str:
        """STRING JSON of the tier's model registry record: the live version, the versions known,
        the previous known-good one, the rollout in progress (`fleet.store.model_registry`)."""
        return self._k("models")

    @property
    def models_history(self) -> str:
        """STREAM, append-only, of every change to the registry record: who, when, why
        (`fleet.store.model_registry`)."""
        return self._k("models:history")

    @property
    def version_outcomes(self) -> str:
        """STREAM (capped) of finished calls by model version: ok or not, TTFT; what a promotion
        is judged on (`fleet.store.version_outcomes`)."""
        return self._k("models:outcomes")

    @property
    def callers(self) -> str:
        """HASH gateway id -> "lease expiry ms|suspected since ms": the gateway processes that
        answer for calls of the tier (`fleet.store.callers`)."""
        return self._k("callers")

    def calls(self, gateway: str) -> str:
        """ZSET request id -> deadline ms: the calls `gateway` answers for, not yet ended
        (`fleet.store.callers`)."""
        return self._k(f"calls:{gateway}")

    @property
    def flow_clock(self) -> str:
        """HASH class rank -> the class's clock in a fair line (`fleet.store.flows`)."""
        return self._k("flows:clock")

    def flow(self, rank: int, flow: str) -> str:
        """STRING "tag|at ms|last call": one flow's place in one class of a fair line (`fleet.store.flows`)."""
        return self._k(f"flow:{rank}:{flow}")

    def request(self, rid: str) -> str:
        """HASH of one request: payload, class, deadline, state, owner, attempt."""
        return self._k(f"req:{rid}")

    def result(self, rid: str) -> str:
        """STREAM of one request's events: tokens, then done or error."""
        return self._k(f"res:{rid}")

    def retry(self, identity: str) -> str:
        """STRING "parked|taken|request id|body digest|tier|reason": a call whose client left,
        kept for a retry of it to take over (`fleet.store.retries`)."""
        return self._k(f"retry:{identity}")

    @property
    def retry_window(self) -> str:
        """HASH `f<epoch second>` first attempts, `r<epoch second>` retries: the tier's retry
        budget window (`fleet.store.retries`)."""
        return self._k("retry-window")


@dataclass(frozen=True, slots=True)
class ApiKeyKeys:
    """Keys of one API key; they share the hash tag `{key:ID}`.

    ID is the key's sha256 digest, not its name: two keys never share limits or a budget,
    whatever they are called, and a name revoked and added again starts afresh."""

    namespace: str
    name: str  # the key's id: its sha256 digest

    @property
    def window(self) -> str:
        """HASH of the rate-limit window: `r:<epoch second>` requests, `t:<epoch second>` tokens."""
        return f"{self.namespace}:{{key:{self.name}}}:window"

    @property
    def budget(self) -> str:
        """HASH of the key's dollar budget: `spent`, `reserved`, `unbilled` (nano-dollars)
        and `r:<request id>` -> "nano|expiry ms" per open reservation (see `fleet.store.key_budget`)."""
        return f"{self.namespace}:{{key:{self.name}}}:budget"


def stored_api_keys(namespace: str) -> str:
    """HASH sha256 hex -> ApiKey JSON: keys an operator added at run time (`fleet keys add`)."""
    return f"{namespace}:apikeys"


def scaler_leader_key(namespace: str) -> str:
    """STRING holding the acting scaler's id under a lease (SET NX PX, renewed each tick)."""
    return f"{namespace}:scaler:leader"
