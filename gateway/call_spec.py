"""A completion request read into what the fleet needs of it: a pure function, no Redis.

`parse_call` validates the body strictly where the fleet reads it (`gateway.schemas`),
resolves its tier, bounds its output, estimates its prompt (tools and response format
included: `fleet.prompt_size`) and builds the payload the line carries to the engine: the
body as the bytes that arrived (`fleet.store.payloads`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleet.config import FleetConfig
from fleet.engine_config import ANTHROPIC_BODY
from fleet.policy import default_max_tokens
from fleet.policy.fairness import call_cost
from fleet.prefix import prefix_key
from fleet.prompt_size import estimate_prompt_tokens
from fleet.store.flows import Place
from fleet.store.payloads import CallPayload, Kind
from gateway.errors import APIError
from gateway.request import validate
from gateway.schemas import ChatBody, CompletionBody


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One call as the fleet reads it."""

    kind: Kind
    body: ChatBody | CompletionBody
    raw: bytes  # the body as it arrived
    tier: str
    max_tokens: int  # the output bound: the caller's, else the tier's default
    explicit_max_tokens: int | None  # what the caller asked for, if it did
    prompt_tokens: int  # estimated
    prefix: str = ""  # its leading messages' hash (`fleet.prefix`): affine claims match it

    @property
    def stream(self) -> bool:
        return self.body.stream

    def payload(self, key: str) -> bytes:
        """What the line carries to the engine (`key`: the caller's key name, for the ledger)."""
        return CallPayload.encode(self.kind, self.raw, max_tokens=self.max_tokens, key=key, stream=self.stream)


def parse_call(kind: Kind, raw: bytes, data: Any, cfg: FleetConfig, *, from_messages: bool = False) -> CallSpec:
    """`data` (the parsed `raw`) as a call, or a typed 404 (no such model) / 422 (a field out of
    bounds) / 400 (a field only the fleet may set). `from_messages`: the gateway's own Messages
    route built `data`, and may carry the caller's Anthropic body to a Messages upstream."""
    if not from_messages and isinstance(data, dict) and ANTHROPIC_BODY in data:
        # Refused, not stripped: the engine gets the bytes that arrived (stripping would re-encode
        # every body), and a caller setting it is told, not silently changed.
        raise APIError(400, f"{ANTHROPIC_BODY} is set by the fleet's /v1/messages route only",
                       param=ANTHROPIC_BODY, code="reserved_field")
    body: ChatBody | CompletionBody = validate(ChatBody if kind == "chat" else CompletionBody, data)
    tier = cfg.resolve_model(body.model)
    if tier is None:
        raise APIError(404, f"model {body.model!r} does not exist; GET /v1/models lists the tiers",
                       param="model", code="model_not_found")
    tc = cfg.tiers[tier]
    explicit = body.max_completion_tokens or body.max_tokens
    max_tokens = body.wanted_tokens(default_max_tokens(tc))
    if max_tokens > tc.max_tokens_limit:
        raise APIError(422, f"max_tokens {max_tokens} exceeds this tier's limit of {tc.max_tokens_limit}",
                       param="max_tokens", code="invalid_value")
    return CallSpec(kind=kind, body=body, raw=raw, tier=tier, max_tokens=max_tokens, explicit_max_tokens=explicit,
                    prompt_tokens=estimate_prompt_tokens(kind, data), prefix=prefix_key(kind, data))


_PLAIN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def call_flow(chain: str, headers: Mapping[str, str], session_headers: list[str], key: str | None,
              client: str | None) -> str:
    """The flow a call belongs to within its class (docs/fair-line.md): its chain (`X-Chain-Id`),
    else the first session header it carries (`fair_line.session_headers`), else its API key,
    else its client address. A session id that is not plain (or too long) is named by its digest:
    the flow is part of a Redis key and of nothing a caller reads back."""
    if chain:
        return f"chain:{chain}"
    for h in session_headers:
        v = headers.get(h)
        if v:
            return f"session:{v}" if _PLAIN.fullmatch(v) else f"session:#{hashlib.sha256(v.encode()).hexdigest()[:32]}"
    if key is not None:
        return f"key:{key}"
    return f"client:{client or 'unknown'}"


def fair_place(cfg: FleetConfig, tier: str, flow: str, *, prompt_tokens: int, output_tokens: int,
               weight: float) -> Place | None:
    """Where a call goes within its class in a fair tier (its flow and its cost); None in a fifo tier."""
    if cfg.tiers[tier].fairness != "fair":
        return None
    fl = cfg.fair_line
    return Place(flow, call_cost(prompt_tokens, output_tokens, output_weight=fl.output_weight, weight=weight),
                 fl.half_life_s)
