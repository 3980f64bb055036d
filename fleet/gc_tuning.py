"""The garbage collector's settings for the fleet's long-running processes (gateway, worker).

The token relay allocates a few short-lived objects per token (a dict per stream entry from
redis-py, the entry's bytes, an event), and CPython starts a generation-0 collection every 700
allocations by default; each tenth of those also walks generation 1, and every so often a full
collection walks every object the process holds: its imports, its engine (torch, vLLM) and
every open call. Profiled at 200 open calls, 16 to 18% of the gateway's CPU was the collector
(docs/token-relay-profile.md; 0.7% with this module, and about 20% less gateway CPU a token).
So a process that serves the relay

- raises the generation-0 threshold (`tune`, at start): a collection per `GEN0` allocations
  costs about what it frees, and the older generations are walked that much less often;
- freezes what it built to start (`freeze`, once started): the modules, the engine, the
  config and clients are never garbage, and a frozen object is never walked again.

Reference cycles are still collected, only later; nothing on the relay's path relies on them.
"""

from __future__ import annotations

import gc

GEN0 = 50_000  # allocations between young collections (CPython's default: 700)
GEN1 = 20  # young collections per middle one (default 10)
GEN2 = 10  # middle collections per full one, at most (the default; CPython also waits for 25% growth)


def tune() -> None:
    """Set the collector's thresholds for a relay process (call once, early)."""
    gc.set_threshold(GEN0, GEN1, GEN2)


def freeze() -> None:
    """Collect once, then move every object the process holds now out of the collector's sight:
    call when start-up is done (the engine loaded, the app's state built)."""
    gc.collect()
    gc.freeze()
