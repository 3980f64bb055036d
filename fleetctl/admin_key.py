"""`fleet gateway --admin-key-on-first-start`: a deployment's first admin key, made once.

A gateway that listens beyond loopback with no key refuses admin endpoints (and calls, unless
`gateway.open: true`; see `gateway.auth`). So that a stack started with `docker compose up` is
usable at once and closed, the gateway makes an admin key on its first start when there is none
in the config or in Redis: `FLEET_ADMIN_KEY` (a secret the operator chose) if set, else a new
one. Only its sha256 is stored (`fleet.store.api_keys`); a new secret is printed once, with how
to use it. Later starts find the key and say nothing of it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time

import click
import redis as sync_redis

from fleet.config import ApiKey, FleetConfig
from fleet.store.api_keys import KeyExists, add_first_admin_key
from fleet.store.connection import connect_sync

NAME = "admin"
REDIS_WAIT_S = 60.0  # Redis may still be starting beside the gateway (compose starts them together)
SHOWN = "fleet: admin key made on first start:"  # scripts/compose.py finds the secret after this


def new_secret() -> str:
    """A key's secret, as `fleet keys add` makes them."""
    return "fk-" + secrets.token_urlsafe(32)


def ensure_admin_key(cfg: FleetConfig, url: str) -> None:
    """Make the first admin key unless one exists (see the module doc); exits 2 if it cannot."""
    if any(k.admin for k in cfg.keys):
        return
    given = os.environ.get("FLEET_ADMIN_KEY", "").strip()
    secret = given or new_secret()
    key = ApiKey(name=NAME, sha256=hashlib.sha256(secret.encode()).hexdigest(), admin=True)
    end = time.monotonic() + REDIS_WAIT_S
    while True:
        try:
            made = add_first_admin_key(connect_sync(url), cfg.namespace, key)
            break
        except KeyExists as e:
            raise click.ClickException(f"--admin-key-on-first-start: {e}; revoke it or make an admin key "
                                       "with `fleet keys add NAME --admin`") from None
        except (sync_redis.ConnectionError, sync_redis.TimeoutError, OSError) as e:
            if time.monotonic() > end:
                raise click.ClickException(f"--admin-key-on-first-start: Redis does not answer: {e}") from None
            time.sleep(1.0)
    if not made:
        return
    if given:
        click.echo(f"fleet: admin key {NAME!r} stored from FLEET_ADMIN_KEY (its sha256 only)")
        return
    click.echo(f"{SHOWN} {secret}\n"
               "  It is shown this once; only its sha256 is stored. Send it as `Authorization: Bearer <key>`\n"
               "  (or FLEET_API_KEY for `fleet status` and `fleet prewarm`) for pre-warm, promote, rollback,\n"
               "  fleet status and calls. Make keys for agents with `fleet keys add NAME`; revoke this one\n"
               f"  with `fleet keys revoke {NAME}` once you have another admin key.", err=False)
