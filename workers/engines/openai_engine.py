"""The `openai` engine: forward to an existing OpenAI-compatible server.

The request goes upstream as the agent sent it (tools, `tool_choice`, `response_format`, logprobs, sampling fields,
messages with their tool calls and content parts, any field the upstream takes), but for `model` (the upstream's),
`stream` and the output bound when the caller gave none. The answer comes back as the upstream sent it: each chunk's
delta members (tool-call fragments, reasoning, refusal) and logprobs, or the whole choice when not streamed; an
upstream 400/413/422 is the caller's 400 with the upstream's message.

A streamed call is forwarded streaming: `/chat/completions` or `/completions` over SSE with
`stream_options.include_usage`, so token counts are the upstream's own; when the upstream sends no usage, completion
tokens are the number of content chunks and prompt tokens an estimate (characters / 4). A non-streamed call is
forwarded non-streamed (one JSON body to parse instead of a chunk per token); the upstream is then silent until it is
done, so only the request's deadline bounds it, not `silence_timeout_s`.

The hot path: one `aiohttp.ClientSession` per engine (a fraction of httpx's CPU per call, which on a small box is what
the forwarding path costs), its connections kept alive and reused: a stream is read to its end after `[DONE]`, off the
caller's path, so its connection goes back to the pool rather than being closed. Bodies are encoded and decoded with
orjson, SSE lines are read as bytes.

Every upstream failure becomes an `EngineError`, never a hang:
    upstream_timeout  connect timeout (code connect_timeout), no byte for
                      `silence_timeout_s` (code silence_timeout), start-up
                      deadline (code start_deadline)
    upstream_error    connection refused or reset (connect_failed,
                      connection_lost), HTTP 401/403/404/408/429/5xx
                      (http_<status>), an error event in the stream
                      (stream_error), a malformed or truncated stream
                      (bad_response, incomplete)
    invalid_request_error  HTTP 400/413/422: the request itself was refused
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Self
from urllib.parse import urlsplit

import aiohttp
import orjson

from fleet.config import OpenAIUpstream, TierConfig
from fleet.engine_config import ANTHROPIC_BODY
from fleet.prompt_size import estimate_prompt_tokens
from workers.engines.anthropic_upstream import ANTHROPIC_VERSION, StreamMap, chat_answer, messages_body
from workers.engines.base import Delta, Engine, EngineError, EngineRequest
from workers.engines.chunks import ChunkReader, whole

log = logging.getLogger(__name__)

_CLIENT_FAULT = {400, 413, 422}
MESSAGES = "/messages"  # Anthropic's route, under the same base_url
_DONE = object()
_ABORTED = object()


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
    return text[:500]


class OpenAIEngine(Engine):
    """Engine contract over an OpenAI-compatible HTTP server.

    Attributes:
        cold_start_s: seconds until the upstream answered GET {base_url}/models.
        model: the model name sent upstream (settings.model, else the first
            model the upstream lists).

    After `abort(request_id)` (or when the consumer closes the iterator) the
    HTTP stream is closed and `generate` ends without a final delta.
    """

    cold_start_s: float = 0.0

    @classmethod
    def for_tier(cls, tier: TierConfig, *, time_scale: float = 1.0) -> Self:
        return cls(tier.openai)  # the upstream keeps its own time

    def __init__(
        self,
        settings: OpenAIUpstream,
        *,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.settings = settings
        self.start_timeout_s = start_timeout_s
        self.model: str = settings.model
        self._base = settings.base_url.rstrip("/")
        self._client: aiohttp.ClientSession | None = None
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._draining: set[asyncio.Task[None]] = set()  # finished streams read to their end


    def _make_client(self) -> aiohttp.ClientSession:
        s = self.settings
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if s.api_key:
            headers["Authorization"] = f"Bearer {s.api_key}"
        return aiohttp.ClientSession(
            headers=headers,
            # No pool limit: the worker's slots bound the calls in flight. Idle connections
            # are kept for reuse (they are what makes a call cheap).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            # sock_read: the silence bound, between any two reads, headers included.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s,
                                          sock_read=s.silence_timeout_s),
            # A proxy from the environment must not capture a loopback upstream.
            trust_env=not _is_loopback(self._base),
            read_bufsize=1 << 20,  # an SSE line (a chunk with logprobs) may exceed the 64 KiB default
        )

    async def start(self) -> None:
        if self._client is None:
            self._client = self._make_client()
        t0 = time.monotonic()
        try:
            await self._wait_ready(t0 + self.start_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self.cold_start_s = time.monotonic() - t0
        log.info("openai upstream %s ready: model=%s cold_start=%.1fs", self._base, self.model, self.cold_start_s)

    async def _wait_ready(self, deadline: float) -> None:
        assert self._client is not None
        last = "no attempt"
        while True:
            try:
                # Each attempt is bounded too, so the deadline holds.
                budget = max(0.1, min(10.0, deadline - time.monotonic()))
                async with self._client.get(f"{self._base}/models",
                                            timeout=aiohttp.ClientTimeout(total=budget)) as r:
                    status, content = r.status, await r.read()
                if status == 200:
                    if not self.model:
                        self.model = _first_model(content)
                    return
                last = f"HTTP {status}: {_error_message(content)}"
                if status in (401, 403, 404):
                    raise EngineError(
                        f"upstream {self._base} refused GET /models: {last}", "upstream_error", f"http_{status}"
                    )
            except (aiohttp.ClientError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"upstream {self._base} did not answer GET /models within {self.start_timeout_s:g}s ({last})",
                    "upstream_timeout",
                    "start_deadline",
                )
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def stop(self) -> None:
        tasks = [*self._readers.values(), *self._draining]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.close()


    @property
    def model_name(self) -> str:
        """The upstream's name for its model: what the caller sees in the answer's `model`."""
        return self.model

    async def abort(self, request_id: str) -> None:
        task = self._readers.get(request_id)
        if task is not None and not task.done():
            task.cancel()

    def _body(self, req: EngineRequest) -> tuple[str, dict[str, Any]]:
        """The caller's request as it sent it, but for the model (the upstream's), how it is read (streamed
        with usage: the upstream's token counts) and the output bound (the fleet's, when the caller gave none).
        A Messages call to an upstream that speaks Anthropic's API (`upstream_api: messages`) goes to its
        `/messages` as sent, model and bound set; to one that does not (degraded), without the Anthropic body."""
        if self.settings.upstream_api == "messages" and req.kind == "chat" and ANTHROPIC_BODY in req.body:
            return MESSAGES, messages_body(req.body, self.model, req.stream, req.max_tokens)
        body = {k: v for k, v in req.body.items() if k != ANTHROPIC_BODY}
        body["model"] = self.model
        body["stream"] = req.stream
        if req.stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        else:
            body.pop("stream_options", None)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = req.max_tokens
        return ("/chat/completions" if req.kind == "chat" else "/completions"), body

    def _headers(self, path: str) -> dict[str, str] | None:
        """Anthropic's own headers on a `/messages` call (its key header beside the bearer one)."""
        if path != MESSAGES:
            return None
        return {"anthropic-version": ANTHROPIC_VERSION, "x-api-key": self.settings.api_key}

    async def generate(self, req: EngineRequest) -> AsyncGenerator[Delta, None]:
        """The upstream's answer as deltas: each streamed chunk's parts as it sent them, then the
        final delta; or, not streamed, its one answer whole (`workers.engines.chunks`)."""
        if self._client is None:
            raise EngineError("engine is not started", "engine_error", "not_started")
        if req.request_id in self._readers:
            raise EngineError(f"request {req.request_id!r} is already running", "invalid_request_error", "duplicate_id")
        path, body = self._body(req)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        read = self._read if req.stream else self._read_whole
        reader = asyncio.create_task(read(self._client, path, body, queue), name=f"openai-{req.request_id}")
        self._readers[req.request_id] = reader
        chunks = ChunkReader(req.kind == "chat", lambda: estimate_prompt_tokens(req.kind, req.body))
        done = False
        try:
            while True:
                # The reader always ends with _DONE, _ABORTED or an EngineError: no wait on a dead reader.
                item = await queue.get()
                if item is _DONE:
                    done = True
                    break
                if item is _ABORTED:
                    return
                if isinstance(item, EngineError):
                    raise item
                if isinstance(item, Delta):  # an answer whole
                    yield item
                    return
                for delta in chunks.feed(item):
                    yield delta
            yield chunks.end()
        finally:
            if done and not reader.done():
                # [DONE] came: the reader reads the rest of the body (the chunked end), so the
                # connection is reused; bounded by the silence timeout.
                self._readers.pop(req.request_id, None)
                self._draining.add(reader)
                reader.add_done_callback(self._draining.discard)
            else:
                if not reader.done():
                    reader.cancel()
                try:
                    # The reader reports through the queue; it raises only CancelledError, never re-raised here.
                    await asyncio.wait({reader})
                finally:
                    self._readers.pop(req.request_id, None)

    async def _read(
        self, client: aiohttp.ClientSession, path: str, body: dict[str, Any], queue: asyncio.Queue[Any]
    ) -> None:
        """Stream one request's SSE events into `queue`; errors become EngineErrors."""
        url = f"{self._base}{path}"
        anthropic = StreamMap() if path == MESSAGES else None
        try:
            async with client.post(url, data=orjson.dumps(body), headers=self._headers(path)) as r:
                if r.status >= 400:
                    _raise_for_status(r.status, await r.read())
                done = False
                async for line in r.content:
                    # After [DONE], read on to the body's end: the connection then goes back to the pool.
                    if done or not line.startswith(b"data:"):
                        continue  # blank separators, comments, event: lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        queue.put_nowait(_DONE)
                        done = True
                        continue
                    try:
                        event = orjson.loads(data)
                    except ValueError:
                        raise EngineError(
                            f"upstream sent malformed data: {data[:200]!r}", "upstream_error", "bad_response"
                        ) from None
                    if not isinstance(event, dict):
                        raise EngineError(
                            f"upstream sent malformed data: {data[:200]!r}", "upstream_error", "bad_response"
                        )
                    if "error" in event:
                        raise EngineError(
                            f"upstream error: {_error_message(data)}", "upstream_error", "stream_error"
                        )
                    done = _put(event, anthropic, queue)
            if not done:  # Stream ended without [DONE]: what arrived still counts if it finished.
                queue.put_nowait(_DONE)
        except BaseException as e:
            _report(e, queue, url, self.settings.silence_timeout_s)
            if isinstance(e, asyncio.CancelledError):
                raise

    async def _read_whole(
        self, client: aiohttp.ClientSession, path: str, body: dict[str, Any], queue: asyncio.Queue[Any]
    ) -> None:
        """One non-streamed call: its answer as one chunk-shaped event, then _DONE."""
        url = f"{self._base}{path}"
        try:
            # No silence timeout: a whole answer is silent until done; the worker's deadline bounds it.
            no_silence = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s)
            async with client.post(url, data=orjson.dumps(body), timeout=no_silence,
                                   headers=self._headers(path)) as r:
                status, content = r.status, await r.read()
            if status >= 400:
                _raise_for_status(status, content)
            try:
                data = orjson.loads(content)
            except ValueError:
                raise EngineError(f"upstream sent a malformed answer: {content[:200]!r}", "upstream_error",
                                  "bad_response") from None
            if not isinstance(data, dict):
                raise EngineError(f"upstream sent a malformed answer: {content[:200]!r}", "upstream_error",
                                  "bad_response")
            if path == MESSAGES:
                data = chat_answer(data)
            queue.put_nowait(whole(data, path != "/completions"))
        except BaseException as e:
            _report(e, queue, url, self.settings.silence_timeout_s)
            if isinstance(e, asyncio.CancelledError):
                raise


def _put(event: dict[str, Any], anthropic: StreamMap | None, queue: asyncio.Queue[Any]) -> bool:
    """Queue one upstream event (Anthropic's as the chat chunks they stand for); True when it ends the answer."""
    if anthropic is None:
        queue.put_nowait(event)
        return False
    for chunk in anthropic.feed(event):
        queue.put_nowait(chunk)
    if event.get("type") == "message_stop":
        queue.put_nowait(_DONE)
        return True
    return False


def _raise_for_status(status: int, body: bytes) -> None:
    """The upstream's refusal, typed: its 400/413/422 is the caller's fault (a 400 with the upstream's
    own message and param), anything else the upstream's."""
    message, param = _error_message(body), _error_param(body)
    if status in _CLIENT_FAULT:
        raise EngineError(message, "invalid_request_error", f"http_{status}", param)
    raise EngineError(f"upstream returned HTTP {status}: {message}", "upstream_error", f"http_{status}")


def _error_param(body: bytes) -> str | None:
    try:
        err = orjson.loads(body).get("error")
        return str(err["param"]) if isinstance(err, dict) and err.get("param") else None
    except (ValueError, AttributeError, TypeError):
        return None


def _report(e: BaseException, queue: asyncio.Queue[Any], url: str, silence_s: float) -> None:
    """Put the reader's end in the queue as the consumer expects it: exactly one of
    _ABORTED (cancelled) or a typed EngineError; never leave the consumer waiting."""
    if isinstance(e, asyncio.CancelledError):
        queue.put_nowait(_ABORTED)
    elif isinstance(e, EngineError):
        queue.put_nowait(e)
    elif isinstance(e, aiohttp.ConnectionTimeoutError):
        queue.put_nowait(EngineError(f"connecting to {url} timed out: {e}", "upstream_timeout", "connect_timeout"))
    elif isinstance(e, aiohttp.SocketTimeoutError):
        queue.put_nowait(EngineError(f"upstream {url} was silent for {silence_s:g}s", "upstream_timeout",
                                     "silence_timeout"))
    elif isinstance(e, TimeoutError):
        queue.put_nowait(EngineError(f"upstream {url} timed out: {e!r}", "upstream_timeout", "timeout"))
    elif isinstance(e, aiohttp.ClientConnectorError):
        queue.put_nowait(EngineError(f"cannot connect to {url}: {e}", "upstream_error", "connect_failed"))
    elif isinstance(e, aiohttp.ClientError):
        queue.put_nowait(EngineError(f"upstream {url} failed: {e!r}", "upstream_error", "connection_lost"))
    else:
        queue.put_nowait(EngineError(f"forwarding to {url} failed: {e!r}", "upstream_error"))


def _first_model(content: bytes) -> str:
    try:
        return str(orjson.loads(content)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise EngineError(
            "openai.model is not set and the upstream lists no models", "engine_config_error", "missing_model"
        ) from e
