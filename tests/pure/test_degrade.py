"""Degrade before shedding (docs/degrade.md): the config's `degrade:` rules checked at start-up,
and the pure decision (`fleet.policy.degrade`) with its properties."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.config import ApiKey, ConfigError, Priority, load_config
from fleet.degrade_config import DEGRADE_REASONS, Degrade
from fleet.policy.degrade import DegradeAsk, degrade, next_tier, rules_of, will
from tests.harness import ROOT

SHIPPED = ROOT / "configs" / "fleet.yaml"
TIERS = ("routing", "analysis", "planner")


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.yaml"
    p.write_text(text)
    return p


def _with_rule(tier: str, rule: str) -> str:
    """The shipped config with `tier`'s degrade rule replaced by `rule` (one YAML flow mapping)."""
    text = SHIPPED.read_text()
    head, sep, rest = text.partition(f"\n  {tier}:")
    assert sep
    block, sep2, tail = rest.partition("\n    sim:")
    lines = [ln for ln in block.split("\n") if not ln.startswith(("    degrade:", "              on:"))]
    return head + sep + "\n".join(lines) + f"\n    degrade: {rule}" + sep2 + tail


# --- config ---------------------------------------------------------------------------------------


def test_shipped_defaults_planner_to_analysis_to_routing_for_the_two_lowest_classes() -> None:
    cfg = load_config(SHIPPED)
    assert cfg.tiers["routing"].degrade is None
    for tier, to in (("planner", "analysis"), ("analysis", "routing")):
        d = cfg.tiers[tier].degrade
        assert d is not None and d.to == to and not d.chain
        assert d.classes == ["speculative", "background"]  # committed and interactive never
        assert set(d.on) == set(DEGRADE_REASONS)  # `on:` read as YAML's boolean true is taken as `on`


@pytest.mark.parametrize(("tier", "rule", "field"), [
    ("planner", "{to: giant}", "tiers.planner.degrade.to: no tier 'giant'"),
    ("planner", "{to: planner}", "tiers.planner.degrade.to: a tier cannot degrade to itself"),
    ("routing", "{to: planner}", "tiers.routing.degrade.to: the degrade rules make a cycle (routing -> planner"),
    ("planner", "{to: analysis, classes: [urgent]}", "tiers.planner.degrade.classes"),
    ("planner", "{to: analysis, on: [too_slow]}", "tiers.planner.degrade.on"),
    ("planner", "{to: analysis, pinned: [small]}", "tiers.planner.degrade.pinned: 'small'"),
    ("planner", "{to: analysis, towards: routing}", "tiers.planner.degrade.towards"),
])
def test_a_bad_rule_stops_start_up_naming_its_field(tmp_path: Path, tier: str, rule: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, _with_rule(tier, rule)))
    assert field in str(e.value)


def test_a_key_sets_its_calls_default_or_forbids_degrading() -> None:
    digest = "a" * 64
    assert ApiKey(name="k", sha256=digest).degrade == "tier"
    assert ApiKey(name="k", sha256=digest, degrade="forbid").degrade == "forbid"
    with pytest.raises(ValueError, match="degrade"):
        ApiKey(name="k", sha256=digest, degrade="sometimes")


# --- the decision -----------------------------------------------------------------------------------

RULES = rules_of(load_config(SHIPPED).tiers)


def ask(**kw: object) -> DegradeAsk:
    base: dict[str, object] = {"tier": "planner", "reason": "budget_exhausted", "priority": Priority.speculative,
                               "model": "planner"}
    return DegradeAsk(**{**base, **kw})  # type: ignore[arg-type]


def test_a_speculative_planner_call_over_budget_goes_to_analysis() -> None:
    assert next_tier(ask(), RULES) == "analysis"
    assert next_tier(ask(priority=Priority.background, reason="drain_exceeded"), RULES) == "analysis"


@pytest.mark.parametrize("kw", [
    {"priority": Priority.committed},  # not listed: never
    {"priority": Priority.interactive},  # not listed
    {"priority": Priority.committed, "wish": "allow"},  # a header cannot make committed degrade
    {"wish": "never"},
    {"key": "never"},
    {"key": "forbid", "wish": "allow"},  # the key's forbid wins over the header
    {"reason": "key_budget_exhausted"},  # not a degrade reason: a key's own limit is the key's
    {"reason": "retry_budget_exhausted"},
    {"tier": "routing"},  # no rule
    {"key_tiers": frozenset({"planner"})},  # the key may not use the target
])
def test_what_is_never_degraded(kw: dict[str, object]) -> None:
    assert next_tier(ask(**kw), RULES) is None


def test_allow_lifts_the_class_list_and_a_key_default_applies_without_a_header() -> None:
    assert next_tier(ask(priority=Priority.interactive, wish="allow"), RULES) == "analysis"
    assert next_tier(ask(priority=Priority.interactive, key="allow"), RULES) == "analysis"
    assert next_tier(ask(key="allow", wish="never"), RULES) is None  # the header overrides the key's default
    assert will(None, "tier") == "tier" and will("allow", "never") == "allow" and will("allow", "forbid") == "never"


def test_a_pinned_alias_is_never_degraded_its_other_names_are() -> None:
    rules = dict(RULES, planner=Degrade(to="analysis", pinned=["large"]))
    assert next_tier(ask(model="large"), rules) is None
    assert next_tier(ask(model="fleet-large"), rules) == "analysis"


def test_committed_degrades_only_where_the_operator_lists_it() -> None:
    rules = dict(RULES, planner=Degrade(to="analysis", classes=["committed"]))
    assert next_tier(ask(priority=Priority.committed), rules) == "analysis"


def test_served_only_where_the_target_admits_else_the_first_refusal_stands() -> None:
    assert degrade(ask(), RULES, lambda t: (True, "")).to == "analysis"  # type: ignore[union-attr]
    assert degrade(ask(), RULES, lambda t: (False, "drain_exceeded")) is None  # analysis does not chain
    chained = dict(RULES, analysis=Degrade(to="routing", chain=True))
    got = degrade(ask(), chained, lambda t: (t == "routing", "drain_exceeded"))
    assert got is not None and (got.asked, got.to, got.reason, got.hops) == ("planner", "routing",
                                                                               "budget_exhausted", 2)


# --- properties -------------------------------------------------------------------------------------

rule_st = st.builds(
    Degrade, to=st.sampled_from(TIERS),
    classes=st.lists(st.sampled_from([p.name for p in Priority]), unique=True),
    on=st.lists(st.sampled_from(DEGRADE_REASONS), min_size=1, unique=True), chain=st.booleans())
rules_st = st.fixed_dictionaries({t: st.none() | rule_st for t in TIERS})
ask_st = st.builds(
    DegradeAsk, tier=st.sampled_from(TIERS), reason=st.sampled_from([*DEGRADE_REASONS, "key_budget_exhausted"]),
    priority=st.sampled_from(list(Priority)), model=st.sampled_from(TIERS),
    wish=st.none() | st.sampled_from(["allow", "never"]), key=st.sampled_from(["tier", "allow", "never", "forbid"]))
# Which tiers would admit, and each refusal's reason.
verdicts_st = st.fixed_dictionaries({t: st.tuples(st.booleans(), st.sampled_from(DEGRADE_REASONS)) for t in TIERS})


@settings(max_examples=400, deadline=None)
@given(ask_st, rules_st, verdicts_st)
def test_properties_of_every_decision(a: DegradeAsk, rules: dict[str, Degrade | None],
                                      verdicts: dict[str, tuple[bool, str]]) -> None:
    judged: list[str] = []

    def judge(t: str) -> tuple[bool, str]:
        judged.append(t)
        return verdicts[t]

    got = degrade(a, rules, judge)
    # Never a tier twice, never back to the one asked: no loop, whatever the rules.
    assert len(judged) == len(set(judged)) and a.tier not in judged
    if got is None:
        return
    # Only where the target's own admission admits.
    assert verdicts[got.to][0] and got.to == judged[-1] and got.asked == a.tier
    # Committed only where the first tier's rule lists it.
    first = rules[a.tier]
    assert first is not None
    if a.priority == Priority.committed:
        assert "committed" in first.classes
    # At most once, unless each further hop's rule chains.
    for hop in judged[:-1]:
        rule = rules[hop]
        assert rule is not None and rule.chain
    assert will(a.wish, a.key) != "never"
    assert got.reason == a.reason  # what the caller is told is the first refusal's reason
