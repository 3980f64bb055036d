"""API keys: who is calling, which tiers and classes they may use, and who is an admin.

Keys live as sha256 digests, never in clear: in the config (`fleet hash-key
SECRET`), or in Redis, where `fleet keys add` puts them at run time and every
gateway picks them up within a heartbeat (revocation likewise). A presented
Bearer token is hashed and compared with every known digest with
`hmac.compare_digest`, with no early exit, so the time taken says nothing
about how close a guess was.

With no keys anywhere, what a gateway allows depends on where it listens
(`Exposure`, set by `gateway.server`): on loopback it runs open (everyone on
this machine may do everything, so `make up` needs no key); beyond loopback
(0.0.0.0, a LAN address) it serves completions only with `gateway.open: true`,
and admin endpoints and fleet state never without a key: a stranger who can
reach the port must not steer the fleet.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import socket
from dataclasses import dataclass

from fastapi import Request
from redis.asyncio import Redis

from fleet.config import CLASSES, ApiKey, FleetConfig, Priority
from fleet.store.api_keys import read_stored_keys
from gateway.errors import APIError, quoted

log = logging.getLogger("fleet.gateway.auth")


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated caller. `key` is None when the gateway runs open."""

    key: ApiKey | None

    @property
    def name(self) -> str:
        return self.key.name if self.key else "open"

    @property
    def admin(self) -> bool:
        return self.key is None or self.key.admin

    def check_tier(self, tier: str) -> None:
        if self.key is not None and self.key.tiers is not None and tier not in self.key.tiers:
            raise APIError(403, f"API key {self.key.name!r} may not use tier {tier!r}", "permission_error",
                           code="tier_not_allowed", param="model")

    def priority(self, header: str | None, default: str) -> Priority:
        """The request's class: its X-Priority, else the key's default; never above the key's highest."""
        if header is not None and header not in CLASSES:  # exactly a class name: no case or space games
            raise APIError(400, f"X-Priority {quoted(header)} is not a class; use one of {', '.join(CLASSES)}",
                           param="X-Priority", code="invalid_priority")
        p = Priority.parse(header if header is not None else (self.key.default_priority if self.key else default))
        if self.key is not None:
            highest = Priority.parse(self.key.max_priority)
            if p < highest:  # a lower value is a higher class
                raise APIError(403, f"API key {self.key.name!r} may send {highest.name} or lower, not {p.name}",
                               "permission_error", code="priority_not_allowed", param="X-Priority")
        return p


class KeyRing:
    """The known keys, by digest: the config's, plus those stored in Redis."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.configured = [(bytes.fromhex(k.sha256.strip().lower()), k) for k in keys]
        self.stored: list[tuple[bytes, ApiKey]] = []
        self.broken: list[bytes] = []  # digests of stored records that do not parse: refused 403, logged
        self.keys = list(self.configured)
        self.sealed = False  # it had keys once and lost them all: refuse everyone rather than open up

    async def refresh(self, redis: Redis, namespace: str) -> None:
        """Reload the keys stored in Redis; a bad entry is skipped and named, never fatal."""
        got = await read_stored_keys(redis, namespace)
        for bad in got.invalid:
            log.error("stored API key %s is invalid and ignored", bad)
        stored = [(bytes.fromhex(key.sha256), key) for key in got.keys]
        self.broken = [bytes.fromhex(d) for d in got.invalid_digests if _hex_digest(d)]
        was_open = self.open
        if not stored and self.stored and not self.configured:
            # The last stored key vanished: revoked, or Redis lost its data. Falling open
            # would hand everyone admin; a gateway that was ever closed stays closed.
            log.error("no API keys are left in Redis; the gateway stays closed (restart it to run open)")
            self.sealed = True
        self.stored = stored
        self.keys = self.configured + stored
        if was_open != self.open:
            log.warning("the gateway now runs %s (%d keys)", "OPEN" if self.open else "closed", len(self.keys))

    @classmethod
    def from_config(cls, cfg: FleetConfig) -> KeyRing:
        ring = cls(cfg.keys)
        if ring.open:
            log.warning("no API keys configured: on loopback the gateway runs OPEN (any caller, any tier, any "
                        "class, admin endpoints included); beyond loopback it serves calls only with gateway.open: "
                        "true and admin endpoints never; add `keys:` or `fleet keys add` to close it")
        else:
            log.info("%d API keys configured; calls need `Authorization: Bearer <key>`", len(ring.keys))
        return ring

    @property
    def open(self) -> bool:
        return not self.keys and not self.sealed

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller behind an Authorization header, or 401 invalid_api_key."""
        if self.open:
            return Caller(None)
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
        digest = hashlib.sha256(token.encode()).digest()
        found: ApiKey | None = None
        broken = False
        for known, key in self.keys:  # every key is compared: the time does not depend on which matched
            if hmac.compare_digest(digest, known):
                found = key
        for known in self.broken:
            if hmac.compare_digest(digest, known):
                broken = True
        if found is None and broken:
            # Its record in Redis does not parse (stored by hand, or by an older `fleet keys add`).
            log.error("a call presented the stored API key %s..., whose record is invalid; refused",
                      digest.hex()[:12])
            raise APIError(403, "this API key's stored record is invalid; an operator must revoke and re-add it",
                           "permission_error", code="invalid_key_record")
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return Caller(found)


def _hex_digest(d: str) -> bool:
    return len(d) == 64 and all(c in "0123456789abcdef" for c in d.lower())


def keyring(request: Request) -> KeyRing:
    ring = getattr(request.app.state, "keyring", None)
    if ring is None:  # an app built without keys at all runs open
        return KeyRing([])
    return ring


@dataclass(frozen=True, slots=True)
class Exposure:
    """Where the gateway listens, as `gateway.server` sets it on the app (`app.state.exposure`)."""

    beyond_loopback: bool  # anyone who can route to this machine may reach it
    open: bool = False  # gateway.open: with no keys, serve completions even so


def beyond_loopback(host: str) -> bool:
    """Whether a listening address reaches past this machine: 0.0.0.0, ::, a LAN address, or a
    name that resolves to one. A name that does not resolve counts as reachable (the safe side)."""
    try:
        addrs = {ipaddress.ip_address(host.strip("[]"))}
    except ValueError:
        try:
            addrs = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except (OSError, ValueError):
            return True
    return not all(a.is_loopback for a in addrs)


def exposure(request: Request) -> Exposure:
    """The app's exposure; an app not served by `gateway.server` (in-process tests) is on loopback."""
    got = getattr(request.app.state, "exposure", None)
    return got if isinstance(got, Exposure) else Exposure(beyond_loopback=False)


NO_KEYS_BEYOND_LOOPBACK = ("this gateway listens beyond loopback and has no API keys")


def authenticate(request: Request) -> Caller:
    """The caller of a call. With no keys anywhere, beyond loopback: 401 unless `gateway.open`."""
    ring = keyring(request)
    if ring.open:
        where = exposure(request)
        if where.beyond_loopback and not where.open:
            raise APIError(401, f"{NO_KEYS_BEYOND_LOOPBACK}: send `Authorization: Bearer <key>` with a key an "
                           "operator made (`fleet keys add NAME`), or set gateway.open: true to serve calls "
                           "without one", code="invalid_api_key")
    return ring.authenticate(bearer(request))


def bearer(request: Request) -> str | None:
    """The Authorization header; else Anthropic's `x-api-key`, as the Bearer token it stands for."""
    auth = request.headers.get("authorization")
    if auth is None and (key := request.headers.get("x-api-key")):
        return f"Bearer {key}"
    return auth


def require_admin(request: Request) -> Caller:
    """Guard a fleet-control endpoint (pre-warm, promote, rollback): 401 without a valid key, 403
    for a key that is not an admin key. With no keys anywhere everyone passes on loopback, and
    nobody beyond it (`gateway.open` opens calls, never these)."""
    if keyring(request).open and exposure(request).beyond_loopback:
        raise APIError(401, f"{NO_KEYS_BEYOND_LOOPBACK}, and its admin endpoints need an admin key: make one "
                       "with `fleet keys add NAME --admin` and send it as `Authorization: Bearer <key>`",
                       code="invalid_api_key")
    caller = authenticate(request)
    if not caller.admin:
        raise APIError(403, f"API key {caller.name!r} is not an admin key", "permission_error",
                       code="admin_required")
    return caller


# Set by gateway.server on requests that came in on the private metrics port (`--metrics-port`).
METRICS_PORT_SCOPE = "fleet.metrics_port"


def require_status_reader(request: Request) -> Caller | None:
    """Guard fleet state (GET /v1/fleet/status, /metrics): replica ids, spend, budgets, decisions.

    The config's `gateway.status_auth`: `open` lets everyone read; `required` needs a key that
    is an admin or has `read_status` (with no keys anywhere, nobody may: use the metrics port);
    `auto` (the default) is `required` as soon as any key exists, in the config or in Redis,
    or when the gateway listens beyond loopback, and `open` while it runs open on loopback. The
    private metrics port is never guarded.
    """
    if request.scope.get(METRICS_PORT_SCOPE):
        return None
    mode = getattr(request.app.state, "status_auth", "auto")
    ring = keyring(request)
    if mode == "open" or (mode == "auto" and ring.open and not exposure(request).beyond_loopback):
        return None
    if ring.open:  # required, yet no key exists that could read it
        raise APIError(401, "fleet state needs an API key with read_status, and none is configured; "
                       "add one, or read /metrics on the private metrics port", code="invalid_api_key")
    caller = ring.authenticate(request.headers.get("authorization"))
    if not (caller.admin or (caller.key is not None and caller.key.read_status)):
        raise APIError(403, f"API key {caller.name!r} may not read fleet state (it needs read_status or admin)",
                       "permission_error", code="read_status_required")
    return caller
