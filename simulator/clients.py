"""Callers that behave like the agent's SDK, in simulated time: a timeout, retries, Retry-After.

A stream or chain with a `client:` (`simulator.client_spec`) makes each call through an `SdkCall`,
as the `openai` client does (`fleet.policy.sdk_client`): an attempt whose whole answer has not come
within `timeout_s` is abandoned; the SDK retries after its backoff (or a refusal's Retry-After,
when honoured and at most a minute), up to `retries` times, and obeys `x-should-retry`.

What the fleet does with it depends on the policy (`SimPolicy.client_clock`):

- on (`fleet`): the gateway's deadline comes from the client's patience (`call_clock`, as
  `gateway.completions` asks it), admission refuses at once what the caller would abandon, a call
  whose caller left while its SDK will retry is parked for `retry_grace_s` and a retry takes it
  over (no new engine work; one nobody takes is cancelled), a call on its SDK's last attempt is
  cancelled when its caller leaves, retries that join nothing spend the tier's retry budget
  (`fleet.policy.retries.retry_allowed`; a retry a refusal invited spends none), and a chain's
  first call is shed before calls of chains under way (`AdmissionInput.opens_chain`);
- off (`fleet-noclock`, and every baseline): every attempt is a new call, and one whose caller
  left runs on in its engine for nobody until it ends or its deadline passes.

Its figures (`Clients.summary`, `callers` in `fleet simulate --json`): attempts per answered call,
agent-seconds spent on abandoned attempts, engine-seconds of calls whose answer nobody received.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.clock_config import ClientClock
from fleet.config import Priority
from fleet.policy.client_clock import call_clock, should_retry
from fleet.policy.retries import retry_allowed
from fleet.policy.sdk_client import retries_refusal, retry_wait_s
from simulator.arrivals import Call
from simulator.client_spec import ClientSpec
from simulator.degrade import Degrader
from simulator.events import CLIENT
from simulator.state import FINISHED, QUEUED, RUNNING, ChainRun, Req, TierSim

_PRIORITIES = tuple(Priority)
MAX_DEADLINE_MS = 86_400_000  # the longest deadline a gateway accepts (`gateway.request`)


class Replay(Protocol):
    """What the callers need of the simulator (`simulator.engine.Simulator`)."""

    t: float
    tiers: dict[str, TierSim]
    degrader: Degrader

    def call_answered(self, ch: ChainRun | None, stage: int, idx: int) -> None: ...

    def chain_end(self, ch: ChainRun, outcome: str, reason: str = "") -> None: ...


class SdkCall:
    """One call an agent makes through its SDK, across its attempts."""

    __slots__ = ("call", "chain", "done", "gen", "header_ms", "idx", "invited", "k", "req", "spec", "stage")

    def __init__(self, call: Call, spec: ClientSpec, header_ms: float | None, chain: ChainRun | None,
                 stage: int, idx: int) -> None:
        self.call, self.spec, self.header_ms = call, spec, header_ms
        self.chain, self.stage, self.idx = chain, stage, idx
        self.k = 0  # this attempt's retry count, as `x-stainless-retry-count` says it
        self.req: Req | None = None  # the call its last attempt made or joined
        self.gen = 0  # bumped as each attempt ends: a timeout armed for an earlier one is stale
        self.invited = False  # the fleet refused its last attempt with a Retry-After: no budget spent
        self.done = False


class RetryWindow:
    """One tier's first attempts and retries per second over the budget's window, as the admission
    script keeps them (`fleet.store.retries.RETRY_GATE`)."""

    __slots__ = ("min_per_s", "per_s", "ratio", "window_s")

    def __init__(self, ratio: float, window_s: float, min_per_s: float) -> None:
        self.ratio, self.window_s, self.min_per_s = ratio, max(1, math.ceil(window_s)), min_per_s
        self.per_s: dict[int, list[int]] = {}  # second -> [firsts, retries]

    def gate(self, now: float, retry: bool, invited: bool) -> bool:
        """Count the attempt; False when it is a retry the budget refuses (`retry_allowed`)."""
        sec = int(now)
        if retry and not invited:
            seen = [self.per_s.get(s, (0, 0)) for s in range(sec - self.window_s + 1, sec + 1)]
            if not retry_allowed(sum(f for f, _ in seen), sum(r for _, r in seen), ratio=self.ratio,
                                 window_s=self.window_s, min_per_s=self.min_per_s):
                return False
        if not invited:
            self.per_s.setdefault(sec, [0, 0])[1 if retry else 0] += 1
            for old in [s for s in self.per_s if s <= sec - 2 * self.window_s]:
                del self.per_s[old]
        return True


@dataclass
class CallerStats:
    """What the callers spent and got."""

    calls: int = 0  # made through an SDK
    answered: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # timed_out (its SDK gave up) | shed | expired
    attempts: int = 0
    answered_attempts: int = 0  # the attempts the answered calls took, their answering one included
    joined: int = 0  # retries that took over the call their caller left
    refused: int = 0  # attempts refused at admission (a 429), the retry budget's included
    budget_refused: int = 0
    abandoned: int = 0  # attempts whose answer did not come within the client's timeout
    abandoned_s: float = 0.0  # agent-seconds spent waiting on those


class Clients:
    """Every SDK call of one replay, and what the gateway does with its attempts."""

    def __init__(self, sim: Replay, serving: Any, policy: Any, seed: int, default_ms: int, clock: ClientClock) -> None:
        """`default_ms`, `clock`: the fleet's `default_deadline_ms` and `client_clock:`, as the gateway reads them."""
        self.sim, self.serving, self.policy = sim, serving, policy
        self.events = serving.events
        self.on = bool(policy.client_clock)
        self.default_ms, self.cc = default_ms, clock
        self.grace = clock.retry_grace_s if self.on else 0.0
        b = clock.retry_budget
        self.windows = {name: RetryWindow(b.ratio, b.window_s, b.min_per_s) for name in sim.tiers}
        self.rng = random.Random(f"{seed}/clients")  # the SDKs' jitter, the same in every replay of a seed
        self.stats = CallerStats()
        self.pending = 0  # SDK calls not yet ended (the replay runs on while any is)
        self.parked = 0  # calls parked for a retry (the replay runs on until each is taken or let go)

    # --- an SDK call and its attempts -------------------------------------------------------

    def start(self, call: Call, spec: ClientSpec, header_ms: float | None, chain: ChainRun | None = None,
              stage: int = 0, idx: int = 0) -> None:
        """An agent makes a call through its SDK: its first attempt, now."""
        self.stats.calls += 1
        self.pending += 1
        self.attempt(SdkCall(call, spec, header_ms, chain, stage, idx))

    def attempt(self, sc: SdkCall) -> None:
        """One attempt reaches the gateway: it takes over the call its caller left, or is judged
        by the retry budget and admission, then joins the line."""
        t = self.sim.t
        self.stats.attempts += 1
        tier = self.sim.tiers[sc.call.tier]
        if self.on:
            r = sc.req
            if sc.k > 0 and r is not None and r.sdk is None and r.parked_until >= t:
                self._join(sc, r)
                return
            if not self.windows[tier.name].gate(tier.start_epoch + t, sc.k > 0, sc.invited):
                self.stats.budget_refused += 1
                self._refused(sc, tier, "retry_budget_exhausted", 1, final=True, left=None)
                return
        sc.invited = False
        deadline_s, judged_s, patience_s, left = self._clock(sc, t)
        if deadline_s <= 0:
            self._fail(sc, "expired")  # its chain's deadline has passed
            return
        call = sc.call
        out = tier.outcomes[call.cls]
        out.arrived += 1
        tier.offered += 1
        if self.policy.sheds:
            obs = tier.observation(t, fresh=False, call=sc.call)
            opens = self.on and sc.chain is not None and sc.stage == 0  # a chain with no call served or open
            d = self.policy.decide(obs, tier.tc, _PRIORITIES[sc.call.cls], sc.call.prompt, judged_s,
                                   patience_s=patience_s, opens_chain=opens)
            moved = None if d.admitted else self.sim.degrader.target(t, call, d.reason or "", judged_s)
            if not d.admitted and moved is None:
                out.shed[d.reason] = out.shed.get(d.reason, 0) + 1
                self._refused(sc, tier, d.reason or "drain_exceeded", d.retry_after_s, final=d.final, left=left,
                              busy_s=obs.busy_s if self.on else 0.0, starting=obs.replicas.starting)
                return
            if moved is not None:  # served by a smaller tier; its SDK's retry would ask the first again
                call, tier = moved
                out = tier.outcomes[call.cls]
        out.accepted += 1
        req = Req(call, tier, t, t + deadline_s, sc.chain, sc.stage, sc.idx)
        req.sdk, sc.req = sc, req
        self.serving.enqueue(tier, req)
        self._arm(sc)

    def _clock(self, sc: SdkCall, t: float) -> tuple[float, float, float | None, int | None]:
        """(deadline, bound judged, patience, retries the gateway expects) of this attempt, in
        seconds: on the caller's clock (`call_clock`, within its chain's deadline) when the
        policy reads it, else its X-Deadline-Ms (a chain's call: the chain's) or the default."""
        left_s = None if sc.chain is None else sc.chain.deadline - t
        if not self.on:
            d = left_s if left_s is not None else (sc.header_ms or self.default_ms) / 1000
            return d, d, None, None
        header = None if sc.header_ms is None else int(sc.header_ms)
        clock = call_clock(header_ms=header, timeout_s=sc.spec.timeout_s, retry_count=sc.k, stream=False,
                           default_ms=self.default_ms, max_ms=MAX_DEADLINE_MS, sdk_retries=self.cc.sdk_retries,
                           joined=self.cc.retry_grace_s > 0)
        if left_s is not None:
            if left_s <= 0:
                return 0.0, 0.0, None, clock.attempts_left
            clock = clock.bounded(int(left_s * 1000))
        patience = None if clock.patience_ms is None else clock.patience_ms / 1000
        return clock.deadline_ms / 1000, clock.judged_ms / 1000, patience, clock.attempts_left

    def _refused(self, sc: SdkCall, tier: TierSim, reason: str, retry_after_s: float, *, final: bool,
                 left: int | None, busy_s: float = 0.0, starting: int = 0) -> None:
        """A typed 429: the SDK obeys its `x-should-retry` (`should_retry`, as the gateway asks it:
        `busy_s` and `starting` as admission observed the tier), waits its Retry-After where it
        honours it, and retries while it has retries left; else the call fails."""
        self.stats.refused += 1
        if reason == "retry_budget_exhausted":
            out = tier.outcomes[sc.call.cls]
            out.arrived += 1
            out.shed[reason] = out.shed.get(reason, 0) + 1
        again = should_retry(retry_after_s=retry_after_s, retryable=not final, attempts_left=left,
                             busy_s=busy_s, starting=starting)
        if sc.k < sc.spec.retries and retries_refusal(429, again, retry_after_s):
            sc.invited = self.on and again  # the gateway noted it asked for this retry
            self._retry_after(sc, retry_after_s)
        else:
            self._fail(sc, "shed", reason)

    def _retry_after(self, sc: SdkCall, retry_after_s: float | None) -> None:
        """The SDK's next attempt, after its wait (`fleet.policy.sdk_client.retry_wait_s`)."""
        b = sc.spec.backoff
        wait = retry_wait_s(sc.k, self.rng.random(), retry_after_s=retry_after_s,
                            honour=sc.spec.honour_retry_after, initial_s=b.initial_s, max_s=b.max_s, jitter=b.jitter)
        sc.k += 1
        self.events.push(self.sim.t + wait, CLIENT, (self.attempt, sc))

    def _arm(self, sc: SdkCall) -> None:
        """The client's timeout for the attempt now waiting on `sc.req`."""
        sc.gen += 1
        self.events.push(self.sim.t + sc.spec.timeout_s, CLIENT, (self._timeout, (sc, sc.gen)))

    def _join(self, sc: SdkCall, r: Req) -> None:
        """A retry takes over the call its caller left (in the admission script, live): no new
        engine work; a whole answer that came meanwhile is read at once."""
        self.stats.joined += 1
        self._unparked(r)
        r.heard = True
        if r.state == FINISHED:
            self._answered(sc)
            return
        r.sdk = sc
        self._arm(sc)

    def _timeout(self, arg: tuple[SdkCall, int]) -> None:
        """The client's timeout fired with no answer: the attempt is abandoned. On, the gateway
        parks the call for the retry its SDK will make (else cancels it); off, it runs on for
        nobody. The SDK retries after its backoff, or gives up."""
        sc, gen = arg
        if sc.done or gen != sc.gen:
            return
        r = sc.req
        assert r is not None and r.state in (QUEUED, RUNNING)
        self.stats.abandoned += 1
        self.stats.abandoned_s += sc.spec.timeout_s
        r.sdk, r.heard = None, False
        if self.on:
            if self.cc.sdk_retries - sc.k > 0 and self.grace > 0:
                r.parked_until = self.sim.t + self.grace
                self.parked += 1
                self.events.push(r.parked_until, CLIENT, (self._unpark, (r, r.parked_until)))
            else:
                self._cancel(r)
        if sc.k < sc.spec.retries:
            self._retry_after(sc, None)
        else:
            self._fail(sc, "timed_out")

    def _unpark(self, arg: tuple[Req, float]) -> None:
        """The grace of a parked call ended and no retry took it: cancelled (or, done, its answer
        kept for the grace goes to nobody)."""
        r, until = arg
        if r.parked_until != until or r.sdk is not None:
            return  # taken over, or parked again
        self._unparked(r)
        if r.state == FINISHED:
            self.unheard(r)
        else:
            self._cancel(r)

    def _unparked(self, r: Req) -> None:
        if r.parked_until > 0:
            r.parked_until = 0.0
            self.parked -= 1

    def _cancel(self, r: Req) -> None:
        self.serving.cancel(r)
        self.nobody(r)

    # --- how a call ended -------------------------------------------------------------------

    def ended(self, req: Req, completed: bool) -> None:
        """A call made through an SDK ended in its tier: its answer goes to the attempt waiting on
        it, is kept for the grace while parked, or goes to nobody. Timed out, its caller (if
        listening) gets a 504, and the SDK call fails."""
        sc = req.sdk
        if completed:
            if sc is not None:
                self._answered(sc)
            elif req.parked_until <= 0:
                self.unheard(req)
            return
        self._unparked(req)
        self.nobody(req)
        if sc is not None:
            self._fail(sc, "expired")

    def nobody(self, req: Req) -> None:
        """The call's answer reached nobody: the engine-seconds it took were for nobody."""
        req.tier.nobody_s += req.engine_s

    def unheard(self, req: Req) -> None:
        """A completed call whose answer reached nobody: not counted as completed (goodput)."""
        self.nobody(req)
        o = req.tier.outcomes[req.call.cls]
        o.completed -= 1
        o.within_objective -= 1  # an SDK's call states its deadline: counted when it completed
        o.useful_tokens -= req.call.output
        o.unheard += 1

    def _answered(self, sc: SdkCall) -> None:
        sc.done, sc.gen = True, sc.gen + 1
        self.pending -= 1
        self.stats.answered += 1
        self.stats.answered_attempts += sc.k + 1
        self.sim.call_answered(sc.chain, sc.stage, sc.idx)

    def _fail(self, sc: SdkCall, why: str, reason: str = "") -> None:
        sc.done, sc.gen = True, sc.gen + 1
        self.pending -= 1
        self.stats.failed[why] = self.stats.failed.get(why, 0) + 1
        if sc.chain is not None:
            self.sim.chain_end(sc.chain, "shed" if why == "shed" else "timed_out", reason)


def summary(stats: CallerStats, tiers: dict[str, TierSim], chains: dict[str, dict[str, int]],
            runs: list[ChainRun]) -> dict[str, Any]:
    """The callers' figures (`callers` in `fleet simulate --json`): what their SDKs spent and got,
    the engine-seconds whose answer nobody received, and the work of chains that failed."""
    engine = sum(t.engine_s for t in tiers.values())
    nobody = sum(t.nobody_s for t in tiers.values())
    done = sum(c["completed"] for c in chains.values())
    failed = [ch for ch in runs if ch.outcome is not None and ch.outcome != "completed"]
    return {
        "calls": stats.calls, "answered": stats.answered, "failed": dict(sorted(stats.failed.items())),
        "attempts": stats.attempts,
        # Every attempt over the calls answered: what the storm cost the fleet per answer; at k x
        # overload at least k whatever the fleet does (each call it cannot serve asks once).
        "attempts_per_answered_call": round(stats.attempts / stats.answered, 3) if stats.answered else None,
        # The attempts an answered call took: what its agent waited through for the answer.
        "attempts_an_answer_took": round(stats.answered_attempts / stats.answered, 3) if stats.answered else None,
        "joined": stats.joined, "refused": stats.refused, "retry_budget_refused": stats.budget_refused,
        "abandoned": stats.abandoned, "agent_s_abandoned": round(stats.abandoned_s, 1),
        "engine_s": round(engine, 1), "engine_s_nobody": round(nobody, 1),
        "engine_nobody_share": round(nobody / engine, 4) if engine > 0 else 0.0,
        "chains_completed": done, "chains_failed": len(failed),
        "engine_s_failed_chains": round(sum((ch.engine_s for ch in failed), 0.0), 1),
    }


def render_callers(c: dict[str, Any]) -> str:
    """The callers' figures for a terminal."""
    head = (f"engine-seconds {c['engine_s']:.0f}, of which for nobody {c['engine_s_nobody']:.0f} "
            f"({c['engine_nobody_share']:.1%}); chains completed {c['chains_completed']}, failed "
            f"{c['chains_failed']} ({c['engine_s_failed_chains']:.0f} engine-seconds spent on them)")
    if not c["calls"]:
        return head
    per, took = c["attempts_per_answered_call"], c["attempts_an_answer_took"]
    failed = ", ".join(f"{k} {v}" for k, v in c["failed"].items()) or "none"
    return (f"callers (SDK clients): {c['calls']} calls, {c['answered']} answered, failed: {failed}; "
            f"{c['attempts']} attempts ({'-' if per is None else f'{per:.2f}'} per answered call; "
            f"{'-' if took is None else f'{took:.2f}'} an answer took): "
            f"{c['joined']} joined, {c['refused']} refused ({c['retry_budget_refused']} by the retry budget), "
            f"{c['abandoned']} abandoned ({c['agent_s_abandoned']:.0f} agent-seconds)\n" + head)


def callers_compare(rows: list[dict[str, Any]]) -> str:
    """`--compare`'s callers table (empty where no caller has an SDK client): per policy, what its
    callers spent and got."""
    rows = [r for r in rows if (r.get("callers") or {}).get("calls")]
    if not rows:
        return ""
    head = ["policy", "answered", "attempts/answered", "attempts/answer", "joined", "refused", "abandoned",
            "agent-s abandoned", "engine-s for nobody", "chains completed", "engine-s failed chains", "replica-h"]
    body = []
    for r in rows:
        c = r["callers"]
        per, took = c["attempts_per_answered_call"], c["attempts_an_answer_took"]
        body.append([r["policy"], str(c["answered"]), "-" if per is None else f"{per:.2f}",
                     "-" if took is None else f"{took:.2f}", str(c["joined"]),
                     str(c["refused"]), str(c["abandoned"]), f"{c['agent_s_abandoned']:.0f}",
                     f"{c['engine_s_nobody']:.0f} ({c['engine_nobody_share']:.1%})", str(c["chains_completed"]),
                     f"{c['engine_s_failed_chains']:.0f}", f"{r['replica_hours']:.2f}"])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths, strict=True)))
             for line in [head, *body]]
    return "\n\ncallers (SDK clients, same trace)\n" + "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])
