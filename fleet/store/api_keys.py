"""API keys stored at run time: `stored_api_keys(namespace)`, sha256 hex -> the key's JSON.

Writer: the command (`fleet keys add`, `fleet keys revoke`, and `fleet gateway
--admin-key-on-first-start` through `add_first_admin_key`), through a blocking
client. Reader: every gateway, each heartbeat (`read_stored_keys`), and
`fleet keys list`. Only digests are stored, never a secret.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis as sync_redis
from pydantic import ValidationError
from redis.asyncio import Redis

from fleet.config import ApiKey
from fleet.store.keys import stored_api_keys


@dataclass(frozen=True, slots=True)
class StoredKeys:
    """The keys read, and the entries that could not be (named, so an operator can fix them)."""

    keys: list[ApiKey]
    invalid: list[str]
    invalid_digests: list[str] = field(default_factory=list)  # so a holder of one is told why it is refused


def _parse(raw: dict[bytes, bytes]) -> StoredKeys:
    keys, invalid, digests = [], [], []
    for digest, value in raw.items():
        try:
            keys.append(ApiKey.model_validate_json(value))
        except (ValidationError, ValueError) as e:
            invalid.append(f"{digest!r}: {e}")
            digests.append(digest.decode(errors="replace") if isinstance(digest, bytes) else str(digest))
    return StoredKeys(keys, invalid, digests)


async def read_stored_keys(redis: Redis, namespace: str) -> StoredKeys:
    """Every stored key; a bad entry is skipped and named, never fatal."""
    return _parse(await redis.hgetall(stored_api_keys(namespace)))


def list_stored_keys(r: sync_redis.Redis, namespace: str) -> StoredKeys:
    return _parse(r.hgetall(stored_api_keys(namespace)))


class KeyExists(ValueError):
    """A stored key of that name exists already."""


def add_stored_key(r: sync_redis.Redis, namespace: str, key: ApiKey, taken: list[str] | None = None) -> None:
    """Store a key; KeyExists if a stored key, or one of `taken` (the config's), has its name."""
    if key.name in (taken or ()):
        raise KeyExists(f"the config has a key named {key.name!r}; pick another name")
    if any(k.name == key.name for k in list_stored_keys(r, namespace).keys):
        raise KeyExists(f"a stored key named {key.name!r} exists; revoke it first")
    r.hset(stored_api_keys(namespace), key.sha256, key.model_dump_json())


def add_first_admin_key(r: sync_redis.Redis, namespace: str, key: ApiKey) -> bool:
    """Store admin key `key` unless an admin key is stored already (then False), in one
    transaction: gateways started together make one first key, not one each."""
    h = stored_api_keys(namespace)
    with r.pipeline(transaction=True) as p:
        while True:
            try:
                p.watch(h)
                stored = _parse(p.hgetall(h))
                if any(k.admin for k in stored.keys):
                    return False
                if any(k.name == key.name for k in stored.keys):
                    raise KeyExists(f"a stored key named {key.name!r} exists and is not an admin key")
                p.multi()
                p.hset(h, key.sha256, key.model_dump_json())
                p.execute()
                return True
            except sync_redis.WatchError:  # another writer in between: look again
                continue


def revoke_stored_key(r: sync_redis.Redis, namespace: str, name: str) -> int:
    """Remove every stored key of that name; how many were removed."""
    h = stored_api_keys(namespace)
    gone = []
    for digest, value in r.hgetall(h).items():
        try:
            if ApiKey.model_validate_json(value).name == name:
                gone.append(digest)
        except (ValidationError, ValueError):
            continue
    if gone:
        r.hdel(h, *gone)
    return len(gone)
