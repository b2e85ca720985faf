"""The ASGI application (Starlette): the OpenAI routes over an EngineWorker.

    POST /v1/chat/completions   POST /v1/completions   (stream true / false)
    GET  /v1/models             GET  /v1/models/{model}
    GET  /health                GET  /metrics

A generation request is parsed and checked on the event loop (specdec.serve.protocol: every
refusal is an OpenAI-style 4xx before the engine sees it), admitted if fewer than
max_in_flight requests are running or waiting (else 503 with Retry-After), submitted to the
worker, and answered from the updates the worker sends back: as server-sent events while they
arrive, or as one JSON body at the end. A client that goes away (a closed stream, or a dropped
connection while a non-streamed request runs) cancels its request in the engine, which frees
its cache row at once. docs/serving.md describes the whole contract.
"""

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec import Request
from specdec.serve import protocol, responses
from specdec.serve.errors import APIError, error_body
from specdec.serve.text_stream import TextStream
from specdec.serve.worker import Update

log = logging.getLogger("specdec.serve")

MAX_BODY_BYTES = 4 * 2**20  # a request body past this is refused (413) before it is parsed
RETRY_AFTER_S = 1  # what a 503 asks clients to wait


@dataclass
class ServerConfig:
    served: protocol.ServedModel
    max_in_flight: int  # running + waiting requests admitted at once (more: 503)
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on /v1/*
    seeded_lane: bool = False  # route seeded sampling to the "seeded" engine (a fixed tree)


class Server:
    """The HTTP side's state: admission, the worker, the metrics. Event-loop thread only."""

    def __init__(self, config: ServerConfig, worker, metrics):
        self.config, self.worker, self.metrics = config, worker, metrics
        self.served = config.served
        self.in_flight = 0
        self.draining = False  # set when shutdown begins: no new request is admitted
        self.created = int(time.time())

    # ------------------------------------------------------------------ routes
    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, protocol.parse_chat, "chatcmpl")

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, protocol.parse_completion, "cmpl")

    async def models(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        return JSONResponse(responses.model_list(self._model_card()))

    async def model(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        name = request.path_params["model"]
        if name != self.served.name:
            raise APIError(404, f"the model {name!r} does not exist", "model", "model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: HTTPRequest) -> Response:
        if self.draining or not self.worker.alive:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: HTTPRequest) -> Response:
        return PlainTextResponse(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: HTTPRequest, parse, id_prefix: str) -> Response:
        arrival = time.perf_counter()
        self._authorize(request)
        body = protocol.parse_json(await _read_body(request))
        gen = parse(body, self.served)
        if self.draining or not self.worker.alive:
            raise APIError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if self.in_flight >= self.config.max_in_flight:
            raise APIError(
                503,
                f"the server is at capacity ({self.config.max_in_flight} requests running or "
                "waiting); retry later",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        call = Call(self, gen, f"{id_prefix}-{uuid.uuid4().hex}", arrival)
        lane = "main"
        if self.config.seeded_lane and gen.params.temperature > 0 and gen.params.seed is not None:
            lane = "seeded"
        self.worker.submit(Request(gen.prompt_ids, gen.params, id=call.id), lane, call.listener)
        if gen.stream:
            return EventStream(self._stream(call), on_close=call.close)
        watcher = asyncio.ensure_future(_wait_disconnect(request, call))
        try:
            result = await call.result()
        finally:
            watcher.cancel()
            call.close()
        if result is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        return JSONResponse(
            responses.completion(
                gen.endpoint,
                call.id,
                call.created,
                self.served.name,
                result.text or "",
                responses.FINISH_REASONS[result.finish_reason],
                responses.usage(len(gen.prompt_ids), len(result.token_ids)),
            )
        )

    async def _stream(self, call: "Call"):
        gen = call.gen
        chunks = responses.ChunkWriter(
            gen.endpoint, call.id, call.created, self.served.name, gen.include_usage
        )
        text = TextStream(self.served.tokenizer, gen.params.stop)
        try:
            while True:
                update = await call.next_update()
                if update.error is not None:
                    call.fail()
                    yield responses.event(error_body(update.status, update.error))
                    yield responses.DONE
                    return
                out = []
                result = update.result
                if call.first_token_time is None and (
                    update.tokens or (result is not None and result.token_ids)
                ):
                    call.first_token_time = time.perf_counter()
                    if gen.endpoint == "chat":
                        out.append(chunks.role())
                delta = text.finish(result.text or "") if result else text.add(update.tokens)
                if delta:
                    out.append(chunks.text(delta))
                if result is not None:
                    reason = call.finish(result)
                    if reason is None:
                        status, message = _failure(result)
                        out.append(responses.event(error_body(status, message)))
                    else:
                        out.append(chunks.finish(reason))
                        if gen.include_usage:
                            out.append(
                                chunks.usage(
                                    responses.usage(len(gen.prompt_ids), len(result.token_ids))
                                )
                            )
                    out.append(responses.DONE)
                if out:
                    yield b"".join(out)
                if result is not None:
                    return
        finally:
            call.close()

    # ------------------------------------------------------------------ helpers
    def _authorize(self, request: HTTPRequest):
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key: send the header Authorization: Bearer <key>",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _model_card(self) -> dict:
        return {
            "id": self.served.name,
            "object": "model",
            "created": self.created,
            "owned_by": "specdec",
            "max_model_len": self.served.context,
        }


class Call:
    """One admitted request on the HTTP side: the updates the worker sends it, its timing, and
    close(), which (once) cancels it in the engine if it has not finished and releases its
    place in the admission count."""

    def __init__(self, server: Server, gen: protocol.GenerationRequest, call_id: str, arrival):
        self.server, self.gen, self.id, self.arrival = server, gen, call_id, arrival
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.updates: asyncio.Queue = asyncio.Queue()
        self.first_token_time: float | None = None
        self.finished = self.closed = False
        self.completion_tokens = 0
        server.in_flight += 1
        server.metrics.admit(1)

    def listener(self, update: Update):
        """The worker's callback (engine thread): onto this request's event loop."""
        self.loop.call_soon_threadsafe(self.updates.put_nowait, update)

    async def next_update(self) -> Update:
        return await self.updates.get()

    async def result(self):
        """Waits for the end -> the Result of a request that completed (stop / length), None
        when the client went away; APIError when it could not complete."""
        while True:
            update = await self.next_update()
            if update is _DISCONNECTED:
                return None
            if update.error is not None:
                self.fail()
                raise APIError(update.status, update.error)
            if update.tokens and self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if update.result is not None:
                if self.first_token_time is None and update.result.token_ids:
                    self.first_token_time = time.perf_counter()
                if self.finish(update.result) is None:
                    status, message = _failure(update.result)
                    raise APIError(status, message)
                return update.result

    def finish(self, result) -> str | None:
        """Records a finished Result -> its OpenAI finish_reason (None: it did not complete)."""
        self.finished = True
        self.completion_tokens = len(result.token_ids)
        reason = responses.FINISH_REASONS.get(result.finish_reason)
        self._observe(reason or result.finish_reason)
        return reason

    def fail(self):
        """The request could not run (the engine refused it, or failed)."""
        self.finished = True
        self._observe("error")

    def close(self):
        if self.closed:
            return
        self.closed = True
        if not self.finished:  # the client went away or the server is stopping
            self.server.worker.cancel(self.id)
            self._observe("cancelled")
        self.server.in_flight -= 1
        self.server.metrics.admit(-1)

    def _observe(self, reason: str):
        now = time.perf_counter()
        first = self.first_token_time
        self.server.metrics.observe_request(
            reason,
            len(self.gen.prompt_ids),
            self.completion_tokens,
            None if first is None else first - self.arrival,
            now - self.arrival,
        )


_DISCONNECTED = Update([], None, None)


def _failure(result) -> tuple:
    """(status, message) of a Result that did not complete."""
    if result.finish_reason == "cancelled":
        return 503, "the request was cancelled: the server is shutting down"
    return 500, f"the engine failed on this request: {result.error}"


async def _wait_disconnect(request: HTTPRequest, call: Call):
    """Wakes the call with _DISCONNECTED when the client drops the connection (the body is
    read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            call.updates.put_nowait(_DISCONNECTED)
            return


async def _read_body(request: HTTPRequest) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer
        raise APIError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


class EventStream(StreamingResponse):
    """A server-sent event stream whose on_close runs however the response ends: finished,
    the client gone before or while it streams, or the server cancelling it."""

    def __init__(self, content, on_close):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def build_app(server: Server) -> Starlette:
    async def api_error(request, exc: APIError):
        server.metrics.http_error(exc.status)
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    async def http_error(request, exc: HTTPException):  # the router's 404 / 405
        server.metrics.http_error(exc.status_code)
        message = {404: f"no route {request.url.path}", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        return JSONResponse(
            error_body(exc.status_code, f"{message} ({request.method} {request.url.path})"),
            exc.status_code,
            headers=exc.headers,
        )

    async def internal_error(request, exc: Exception):
        log.exception("request failed: %s %s", request.method, request.url.path)
        server.metrics.http_error(500)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500)

    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={
            APIError: api_error,
            HTTPException: http_error,
            Exception: internal_error,
        },
    )
