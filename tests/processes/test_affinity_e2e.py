"""Prefix affinity end to end: gateway -> Redis line -> two sim workers. Every turn of a
conversation (the same leading messages, growing) lands on the replica that served its first."""

from __future__ import annotations

import httpx

from tests.harness import Fleet, wait_until

SYSTEM = {"role": "system", "content": "You are a trading agent with tools."}


def turn(f: Fleet, messages: list[dict], chain: str = "") -> tuple[str, str]:
    """One call; its request id and the reply's text."""
    headers = {"x-chain-id": chain} if chain else {}
    r = httpx.post(f"{f.base_url}/v1/chat/completions", headers=headers, timeout=30,
                   json={"model": "routing", "messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"], r.json()["choices"][0]["message"]["content"]


def served_by(f: Fleet, rid: str) -> str:
    owner = f.r.hget(f.keys("routing").request(rid), "owner")
    assert owner, rid
    return owner.decode().rsplit(":", 1)[0]


def test_the_turns_of_each_conversation_stay_on_one_replica(fleet: Fleet) -> None:
    fleet.start_gateway()
    a, b = fleet.start_worker("routing", wait=False), fleet.start_worker("routing", wait=False)
    wait_until(lambda: fleet.replica_state("routing", a) == fleet.replica_state("routing", b) == "ready", 60,
               what="two replicas ready")
    for chain in ("", "desk-7"):
        for conv in range(3):
            msgs = [SYSTEM, {"role": "user", "content": f"conversation {conv} {chain}: price the book"}]
            where = []
            for k in range(4):  # sequential turns, each re-sending the whole conversation
                rid, text = turn(fleet, msgs, chain=f"{chain}-{conv}" if chain else "")
                where.append(served_by(fleet, rid))
                msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": f"and {k}?"}]
            assert len(set(where)) == 1, where  # both replicas idle each time: affinity, not chance, decides
    held = {k.decode(): int(v) for k, v in fleet.r.hgetall(fleet.keys("routing").affinity_count).items()}
    assert sum(held.values()) == 6 and set(held) <= {a, b}  # the scaler reads what each replica holds
