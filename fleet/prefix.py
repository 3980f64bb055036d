"""A call's prefix key: what an affine claim matches against the prefixes a replica has cached
(`fleet.store.affinity`, docs/prefix-affinity.md). Pure: no I/O.

The chain id, when the caller sends one (`X-Chain-Id`), names the conversation outright.
Without it, a chat call's key is a hash of its tools and its leading messages up to and including
the first that is not a system (or developer) message: every turn of one conversation re-sends
that same start, while two conversations that share only a system prompt and tools (which
every replica soon caches anyway) differ in it. A completion prompt has no such structure: it
gets a key only from its chain id.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_LEADING_ROLES = ("system", "developer")


def prefix_key(kind: str, data: Any) -> str:
    """The hash of a chat call's tools and leading messages, "" when it has none to hash."""
    if kind != "chat" or not isinstance(data, dict) or not isinstance(msgs := data.get("messages"), list):
        return ""
    lead: list[Any] = []
    for m in msgs:
        lead.append(m)
        if not isinstance(m, dict) or m.get("role") not in _LEADING_ROLES:
            break
    if not lead:
        return ""
    blob = json.dumps([data.get("tools"), lead], sort_keys=True, separators=(",", ":"), default=str)
    return "p:" + hashlib.blake2b(blob.encode(), digest_size=12).hexdigest()


def affinity_key(chain: str, prefix: str) -> str:
    """The key an affine claim matches: the chain id if given, else the prefix hash."""
    return f"c:{chain}" if chain else prefix
