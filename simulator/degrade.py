"""Degrade before shedding, in simulated time: a call its tier's admission refuses asks the same
pure decision as the gateway (`fleet.policy.degrade.degrade`), and the target tier's admission is
the policy's, on that tier as it stands (docs/degrade.md).

The replay has no API keys and no `X-Fleet-Degrade`: the tiers' rules decide. A degraded call
keeps its prompt and output lengths (the trace's; a smaller model's answer is taken to be as
long), waits in the target's line, is served and billed there, and is counted at the tier it
asked (`degraded` by reason, `degraded_to` by target) and at the tier that served it
(`degraded_in`, beside `accepted`). `fleet simulate --no-degrade` replays without the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from fleet.config import Priority
from fleet.degrade_config import Degrade
from fleet.policy import TierObservation
from fleet.policy.degrade import DegradeAsk, degrade, rules_of
from simulator.arrivals import Call
from simulator.state import Outcome, TierSim

__all__ = ["Degrader", "rules_of"]

# What the replay's admission answers: None (admitted) or the refusal's reason.
Admit = Callable[[TierObservation, TierSim, Priority, int, float], "str | None"]


class Degrader:
    """The tiers' degrade rules, and the one question the replay asks of them."""

    def __init__(self, tiers: Mapping[str, TierSim], admit: Admit) -> None:
        self.tiers = tiers
        self.admit = admit
        self.rules: dict[str, Degrade | None] = rules_of({n: t.tc for n, t in tiers.items()})
        self.on = any(r is not None for r in self.rules.values())

    def target(self, t: float, call: Call, reason: str, deadline_s: float) -> tuple[Call, TierSim] | None:
        """The call as the tier that admits it instead would serve it, and that tier; None: it is
        shed for `reason`, as its tier said. Counted at both tiers when it degrades."""
        if not self.on:
            return None
        prio = Priority(call.cls)

        def judge(name: str) -> tuple[bool, str]:
            tier = self.tiers[name]
            why = self.admit(tier.observation(t, fresh=False, call=replace(call, tier=name)), tier, prio,
                             call.prompt, deadline_s)
            return why is None, why or ""

        got = degrade(DegradeAsk(call.tier, reason, prio, model=call.tier), self.rules, judge)
        if got is None:
            return None
        asked, served = self.tiers[call.tier].outcomes[call.cls], self.tiers[got.to].outcomes[call.cls]
        count(asked, served, got.to, reason)
        return replace(call, tier=got.to), self.tiers[got.to]


def count(asked: Outcome, served: Outcome, to: str, reason: str) -> None:
    asked.degraded[reason] = asked.degraded.get(reason, 0) + 1
    asked.degraded_to[to] = asked.degraded_to.get(to, 0) + 1
    served.degraded_in += 1  # its `accepted` is counted where it is enqueued, as any call's
