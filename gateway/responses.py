"""The Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is one chat call (`gateway.responses_map.chat_body`), read and counted as
the completion routes read theirs (`gateway.completions.read_call`) and served by the same
`gateway.call.Call`: the same line, admission, classes, deadlines, budgets and typed refusals.
Only its answer is written differently: whole (`output_items`), or streamed as the Responses
events (`gateway.responses_stream`, a render of the chat stream loop in `gateway.answers`).

State lives in Redis (`fleet.store.responses`): with `store: true` (the default) the response
and the conversation leading to it are kept for `responses.ttl_s`, so any gateway process
continues it (`previous_response_id`), before or after a restart. Only the key that made a
response can read, continue or delete it; to any other key it does not exist (404).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from redis.exceptions import RedisError

from fleet.store.events import Chunk, Done
from fleet.store.replication import Ack
from fleet.store.responses import StoredResponse
from gateway.answers import stream
from gateway.answers import whole as answer_whole
from gateway.auth import Caller, authenticate
from gateway.call import Call
from gateway.call_spec import CallSpec, parse_call
from gateway.client_watch import ClientGone, ClientWatch
from gateway.completions import read_call
from gateway.errors import APIError
from gateway.redis_loss import unavailable_error
from gateway.request import validate
from gateway.responses_map import chat_body, input_items, json_size, new_id, output_items, response_object
from gateway.responses_schema import ResponsesBody, unsupported_fields
from gateway.responses_stream import ResponsesRender
from gateway.state import Gateway

router = APIRouter()


@dataclass(slots=True)
class Turn:
    """One Responses call: its body, its id, and the conversation it continues."""

    body: ResponsesBody
    id: str
    created_at: float
    owner: str
    history: list[dict[str, Any]]  # the stored conversation it continues ([] for a new one)
    items: list[dict[str, Any]]  # its own new input items


def owner_of(caller: Caller) -> str:
    """Who a stored response belongs to: the key's digest (a key re-made under the same name is
    another key), or "open" on a gateway without keys."""
    return caller.key.sha256 if caller.key is not None else "open"


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id {response_id[:80]!r} not found.", param=param, code="response_not_found")


@router.post("/v1/responses")
async def create(request: Request) -> Response:
    gw: Gateway = request.app.state.gw
    turns: list[Turn] = []

    async def parse(caller: Caller, raw: bytes, data: Any) -> CallSpec:
        turn, spec = await read_turn(gw, caller, data)
        turns.append(turn)
        return spec

    caller, spec, headers = await read_call(request, "chat", gw.cfg, parse)
    turn = turns[0]
    try:
        async with Call(gw, spec, caller, headers, ClientWatch(request.receive)) as call:
            first = await call.first()
            if call.degraded_from:  # the Response names the tier that served it (docs/degrade.md)
                turn = replace(turn, body=turn.body.model_copy(update={"model": call.spec.tier}))
            if spec.stream:
                head = response_object(turn.id, turn.body, turn.created_at)
                return stream(call, first, ResponsesRender(head, lambda out, done: keep(gw, turn, out, done)))
            return await whole(call, first, gw, turn)
    except ClientGone:  # ended as cancelled; nobody reads this
        return Response(status_code=499)


async def read_turn(gw: Gateway, caller: Caller, data: Any) -> tuple[Turn, CallSpec]:
    """The Responses body as a turn and the chat call it runs as; a typed 400 (unsupported, past
    the store's bounds), 404 (no such previous response, for this key) or 422 (a field)."""
    unsupported_fields(data)
    body: ResponsesBody = validate(ResponsesBody, data)
    owner = owner_of(caller)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = await gw.responses.get(body.previous_response_id, owner)
        if prev is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        if prev.conversation is None:
            raise _too_large("conversation", "previous_response_id",
                             f"response {prev.id!r} was past the store's bound when it ended, so its conversation "
                             "was not kept")
        history = prev.conversation
    items = input_items(body)
    if not history and not items:
        raise APIError(422, "input: required unless previous_response_id is given", param="input",
                       code="invalid_value")
    bounds = gw.cfg.responses
    if body.store:  # what is kept is bounded; a turn past a bound is refused before it runs
        size = json_size(items)
        if size > bounds.max_response_bytes:
            raise _too_large("response", "input", f"this turn's input is {size} bytes, over "
                             f"responses.max_response_bytes ({bounds.max_response_bytes})")
        size += json_size(history)
        if size > bounds.max_conversation_bytes:
            raise _too_large("conversation", "previous_response_id", f"the conversation would be {size} bytes, "
                             f"over responses.max_conversation_bytes ({bounds.max_conversation_bytes})")
    chat = chat_body(body, history + items)
    try:
        spec = parse_call("chat", orjson.dumps(chat), chat, gw.cfg)
    except APIError as e:  # the chat call's names for what the caller sent under the Responses names
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
        raise
    return Turn(body, new_id("resp"), time.time(), owner, history, items), spec


def _too_large(what: str, param: str, why: str) -> APIError:
    return APIError(400, f"{why}; start a new conversation, or send the items yourself with store: false",
                    param=param, code=f"{what}_too_large")


async def keep(gw: Gateway, turn: Turn, output: list[dict[str, Any]], done: Done) -> dict[str, Any]:
    """The completed Response, stored first when it asked to be (so a continuation that follows
    at once finds it on any gateway). Past a bound (its output is only known now), the response
    is kept without its conversation. Redis failing to keep it: a typed 503, never a silent miss."""
    response = response_object(turn.id, turn.body, turn.created_at, output=output, done=done)
    if not turn.body.store:
        return response
    bounds = gw.cfg.responses
    conversation: list[dict[str, Any]] | None = turn.history + turn.items + output
    if (json_size(turn.items) + json_size(output) > bounds.max_response_bytes
            or json_size(conversation) > bounds.max_conversation_bytes):
        conversation = None
    rep = gw.cfg.replication
    try:
        await gw.responses.put(StoredResponse(turn.id, turn.owner, response, conversation),
                               Ack(rep.ack_replicas, rep.ack_timeout_ms))
    except (RedisError, TimeoutError) as e:
        raise unavailable_error(e) from None
    return response


async def whole(call: Call, first: Done | Chunk, gw: Gateway, turn: Turn) -> Response:
    """A Responses call answered whole: the Response object (the answer ends the call:
    `gateway.answers.whole`)."""

    async def make(call: Call, done: Done) -> Response:
        output = output_items((done.choice or {}).get("message") or {})
        response = await keep(gw, turn, output, done)
        return Response(orjson.dumps(response), media_type="application/json", headers=call.headers)

    return await answer_whole(call, first, make)


@router.get("/v1/responses/{response_id}")
async def read(request: Request, response_id: str) -> Response:
    """A stored response, to the key that made it."""
    gw: Gateway = request.app.state.gw
    rec = await gw.responses.get(response_id, owner_of(authenticate(request)))
    if rec is None:
        raise not_found(response_id)
    return Response(orjson.dumps(rec.response), media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str) -> Response:
    """Delete a stored response (the key that made it only); continuing it is then a 404."""
    gw: Gateway = request.app.state.gw
    if not await gw.responses.delete(response_id, owner_of(authenticate(request))):
        raise not_found(response_id)
    return Response(orjson.dumps({"id": response_id, "object": "response.deleted", "deleted": True}),
                    media_type="application/json")
