"""A stored response of the Responses API: `<namespace>:resp:<id>`, a STRING of JSON with a TTL.

Writer: the gateway's Responses route, once per response that asked to be stored (`store: true`,
OpenAI's default), when its answer is complete (`ResponseStore.put`); and `DELETE
/v1/responses/{id}` (`ResponseStore.delete`). Reader: the same route, for `GET
/v1/responses/{id}` and for a call that continues it (`previous_response_id`):
`ResponseStore.get`.

One key a response, holding all a continuation needs: the conversation up to and including the
response's own output (as Responses input items, `instructions` excepted: OpenAI does not carry
them over). So any gateway process continues any conversation with one GET, on a Redis Cluster
too (one key, one slot, no hash tag needed), and a response outlives the gateway that answered.
The price is that each turn stores its conversation again (bounded: `responses.max_*_bytes`);
see docs/decisions/0079-responses-conversations-in-redis.md.

`owner` is the sha256 of the API key that made it ("open" on a gateway without keys): only that
key may read, continue or delete it, and any other is told it does not exist. A response whose
conversation was past the bound when it ended keeps its response object but not its
conversation (`conversation` None): it can be read, and continuing it is refused with a typed
400 rather than pretending it never existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from fleet.store.replication import Ack, Replicas


def response_key(namespace: str, response_id: str) -> str:
    return f"{namespace}:resp:{response_id}"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    owner: str  # the sha256 of the key that made it, or "open"
    response: dict[str, Any]  # the Response object as its caller got it
    conversation: list[dict[str, Any]] | None  # input items leading to it, then its output; None: past the bound

    def encode(self) -> bytes:
        return orjson.dumps({"id": self.id, "owner": self.owner, "response": self.response,
                             "conversation": self.conversation})

    @classmethod
    def decode(cls, raw: bytes | str) -> StoredResponse | None:
        """The record, or None for one that does not parse (written by hand or by another version):
        a continuation then sees no such response, not a 500."""
        try:
            d = orjson.loads(raw)
            conv = d.get("conversation")
            if not isinstance(d["response"], dict) or not (conv is None or isinstance(conv, list)):
                return None
            return cls(id=str(d["id"]), owner=str(d["owner"]), response=d["response"], conversation=conv)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None


class ResponseStore:
    """The stored responses of one fleet namespace (one per gateway process: it keeps the replica count)."""

    def __init__(self, redis: Redis, namespace: str, ttl_s: int) -> None:
        self.redis, self.namespace, self.ttl_s = redis, namespace, ttl_s
        # Where Redis has replicas, a stored response waits for one as an enqueue does (the
        # replication settings): a failover must not lose the turn a caller continues from. On a
        # cluster the count is read from one key's master; the WAIT goes to the record's own.
        self.replicas = Replicas(redis, response_key(namespace, ""))

    async def put(self, rec: StoredResponse, ack: Ack | None = None) -> None:
        key, value = response_key(self.namespace, rec.id), rec.encode()
        if ack is None or ack.replicas == 0 or await self.replicas.known() == 0:
            await self.redis.set(key, value, ex=self.ttl_s)
            return
        async with self.redis.pipeline(transaction=False) as p:  # the SET and its WAIT on one connection
            p.set(key, value, ex=self.ttl_s)
            if isinstance(self.redis, RedisCluster):
                p.execute_command("WAIT", ack.replicas, ack.timeout_ms, target_nodes=self.redis.get_node_from_key(key))
            else:
                p.execute_command("WAIT", ack.replicas, ack.timeout_ms)
            _, n = await p.execute()
        if int(n) < ack.replicas:
            self.replicas.fell_short()

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it exists, has not expired and belongs to `owner` (else None: a stranger
        cannot tell someone else's response from one that never was)."""
        raw = await self.redis.get(response_key(self.namespace, response_id))
        rec = StoredResponse.decode(raw) if raw is not None else None
        return rec if rec is not None and rec.owner == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete `owner`'s response; False when there is none of theirs."""
        if await self.get(response_id, owner) is None:
            return False
        return bool(await self.redis.delete(response_key(self.namespace, response_id)))
