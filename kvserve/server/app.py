"""The HTTP API: OpenAI completions and chat, models, health, metrics and the KV dashboard."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.engine.chat_template import chat_prompt_ids
from kvserve.engine.sequence import RequestOutput
from kvserve.server.async_engine import Draining, QueueFull
from kvserve.server.front import EngineFront
from kvserve.server.settings import ServerSettings
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, _Common, error_body, field_of
from kvserve.server.rendering import Rendering, longest_token_bytes, token_bytes_of
from kvserve.server.reply import Reply
from kvserve.validate import check_utf8


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, type_), status_code=status, headers=headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    """The field a pydantic error is about: its location without "body" and without the union
    member pydantic tried ("prompt.str", "prompt.list[int].0" -> "prompt")."""
    parts: list[str] = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS):
            break
        parts.append(str(part))
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "nullable"}
# Routes any client may call without the API key (load balancers probe /health).
_OPEN_PATHS = ("/health", "/")  # "/" is the dashboard page: it holds no data, it fetches it


class _Guard:
    """Host, API key and body size, checked before any route runs. Plain ASGI (not FastAPI's
    `BaseHTTPMiddleware`), so handlers still see their client's disconnect."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if (refusal := self.refusal(scope["path"], headers)) is not None:
            await refusal(scope, receive, send)
            return
        if "content-length" not in headers:
            # A chunked body declares no length: count it as it arrives, so it cannot pass the
            # limit. The limit bounds what is held here; the route then reads it back.
            body = await self.read_chunked(receive)
            if body is None:
                limit = self.settings.max_request_bytes
                await _error(413, f"request body exceeds the server's limit of {limit} bytes "
                                  f"(--max-request-bytes)")(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def read_chunked(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit."""
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the route sees an empty body
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.settings.max_request_bytes:
                return None
        return bytes(body)

    def refusal(self, path: str, headers: Headers) -> JSONResponse | None:
        settings = self.settings
        # DNS rebinding: a page on another origin reaches a local server under its own name.
        if not settings.host_allowed(headers.get("host")):
            return _error(400, f"Host {headers.get('host')!r} is not served here (see --allowed-hosts)")
        if settings.api_key is not None and path not in _OPEN_PATHS:
            # The scheme's name is case-insensitive (RFC 9110, 11.1): "bearer KEY" is "Bearer KEY".
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.lstrip(" ").encode(),
                                                                     settings.api_key.encode()):
                return JSONResponse(error_body("invalid or missing API key (Authorization: Bearer ...)", None,
                                               "invalid_request_error", "invalid_api_key"), status_code=401)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > settings.max_request_bytes:
            return _error(413, f"request body of {int(length)} bytes exceeds the server's limit of "
                               f"{settings.max_request_bytes} (--max-request-bytes)")
        return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` once, then the client's own messages (its disconnect)."""
    given = False

    async def replayed() -> dict[str, Any]:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replayed


def build_app(aengine: EngineFront, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    tokenizer = aengine.tokenizer
    model_name = settings.model_name or aengine.model_name
    app = FastAPI(title="kvserve", description="OpenAI-compatible server of the kvserve engine")

    app.add_middleware(_Guard, settings=settings)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own errors (a body it cannot parse, an unknown route) in OpenAI's shape.
        return _error(exc.status_code, str(exc.detail), None,
                      "invalid_request_error" if exc.status_code < 500 else "internal_error")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return _error(400, f"request body is not valid JSON: {err.get('msg')}")
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "extra_forbidden":  # named whole, whatever characters its name has
            param = ".".join(filter(None, (_param(loc[:-1]), str(loc[-1]))))
            return _error(400, f"{param}: not a field this server takes; an option it does not know "
                               f"is refused, never ignored", param)
        param = _param(loc)
        if param is None and "json" not in request.headers.get("content-type", ""):
            # FastAPI reads a body as JSON only when told so; curl -d sends a form type.
            return _error(400, "the request body must be a JSON object sent with Content-Type: application/json")
        return _error(400, f"{param or 'body'}: {err.get('msg')}", param)

    @app.get("/health")
    async def health() -> Response:
        # 503 while draining for shutdown: load balancers stop sending here.
        return Response(status_code=503 if aengine.draining else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "kvserve", "max_model_len": aengine.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await aengine.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/kv/state", response_model=None)
    async def state(replica: str | None = None) -> dict[str, Any] | JSONResponse:
        try:
            return await aengine.kv_state(settings.expose_request_ids, replica)
        except ValueError as err:
            return _error(400, str(err), "replica")

    @app.get("/", response_class=HTMLResponse)
    async def dashboard() -> str:
        return resources.files("kvserve.server").joinpath("dashboard.html").read_text()

    def refusal(req: _Common) -> JSONResponse | None:
        """An unknown model or an option the engine does not do, before any work on the prompt."""
        if req.model is not None and req.model != model_name:
            return JSONResponse(error_body(f"the model {req.model!r} does not exist; this server serves "
                                           f"{model_name!r} (GET /v1/models)", "model", "invalid_request_error",
                                           "model_not_found"), status_code=404)
        if (bad := req.unsupported()) is not None:
            return _error(400, bad[1], bad[0])
        return None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        if (refused := refusal(req)) is not None:
            return refused
        prompts = req.prompts()
        if not prompts:
            return _error(400, "prompt: must hold at least one prompt", "prompt")
        if tokenizer is None and any(isinstance(p, str) for p in prompts):
            return _error(400, "this model has no tokenizer; send token ids as the prompt", "prompt")
        try:
            for p in prompts:
                if isinstance(p, str):
                    check_utf8("prompt", p)
        except ValueError as err:
            return _error(400, str(err), "prompt")
        for p in prompts:
            if isinstance(p, str) and (why := surely_too_long([p])) is not None:
                return _error(400, f"prompt: {why}", "prompt")
        # Off the event loop: a huge prompt must not stall /health and every other client.
        prompts = await asyncio.to_thread(lambda: [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts])
        return await _generate(req, prompts, req.max_tokens, False, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        if (refused := refusal(req)) is not None:
            return refused
        if tokenizer is None or not tokenizer.chat_template:
            return _error(400, "this model has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        for i, m in enumerate(messages):
            try:
                check_utf8(f"messages.{i}.content", m["content"])
            except ValueError as err:
                return _error(400, str(err), f"messages.{i}.content")
        if (why := surely_too_long([m["content"] for m in messages])) is not None:
            return _error(400, f"messages: {why}", "messages")
        ids = await asyncio.to_thread(chat_prompt_ids, tokenizer, messages)
        max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                          max(aengine.max_model_len - len(ids), 1))
        return await _generate(req, [ids], max_tokens, True, request)

    def token_text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"

    token_bytes = token_bytes_of(tokenizer, token_text)
    longest_token = longest_token_bytes(tokenizer)

    def surely_too_long(texts: list[str]) -> str | None:
        """Why `texts` cannot fit the context whatever they tokenize to, without tokenizing them."""
        if longest_token is None:
            return None
        size = sum(len(t.encode()) for t in texts)
        tokens = -(-size // longest_token)
        if tokens < aengine.max_model_len:
            return None
        return (f"{size} bytes of text are at least {tokens} tokens (no token of this "
                f"tokenizer covers more than {longest_token} bytes), which leave no room to generate within "
                f"the context length max_model_len={aengine.max_model_len}")

    async def _generate(req: _Common, prompts: list[list[int]], max_tokens: int, chat: bool,
                        request: Request) -> Response:
        echo = isinstance(req, CompletionRequest) and req.echo
        score_only = isinstance(req, CompletionRequest) and req.score_only
        try:
            # Scoring a prompt still runs the engine's one-token minimum; that token is dropped.
            params = req.sampling_params(1 if score_only else max_tokens)
        except ValueError as err:
            return _error(400, str(err), field_of(err))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            rids, sink = await aengine.submit(prompts, params, request_id, req.cache_salt)
        except QueueFull as err:
            return _error(429, f"server busy: {err}; retry later", None, "rate_limit_error",
                          {"Retry-After": str(settings.retry_after_s)})
        except Draining as err:
            return _error(503, str(err), None, "service_unavailable")
        except ValueError as err:
            param = field_of(err)
            return _error(400, str(err), "messages" if chat and param == "prompt" else param)
        reply = Reply(request_id, model_name, chat, rids, params.n if params.beam_width == 1 else 1,
                       Rendering(tokenizer, token_text, token_bytes, echo, score_only))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(reply, sink, include_usage), media_type="text/event-stream")
        try:
            checked = time.monotonic()
            while reply.pending:
                try:
                    reply.take(await asyncio.wait_for(sink.get(), DISCONNECT_POLL_S))
                except asyncio.TimeoutError:
                    pass
                # A client that hung up would otherwise keep its request running to max_tokens.
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return Response(status_code=499)
        finally:
            if reply.pending:  # the client went away, or the handler was cancelled
                aengine.abort(list(reply.pending))
        if reply.error:
            status, kind = reply.error_status()
            return _error(status, reply.error, None, kind)
        return JSONResponse(reply.body())

    async def _stream(reply: Reply, sink: Any, include_usage: bool) -> AsyncIterator[str]:
        try:
            if reply.chat:
                for index in range(reply.num_choices):
                    yield _sse(reply.chunk(index, {"role": "assistant", "content": ""}, None))
            while reply.pending:
                # Everything that arrived since the last write goes out in one: a slow reader
                # costs fewer sends, not more.
                items = [await sink.get()]
                while not sink.empty():
                    items.append(sink.get_nowait())
                events = []
                for item in items:
                    reply.take(item)
                    if isinstance(item, RequestOutput) and item.finish_reason != "error":
                        if item.delta_text or item.finished or reply.has_new_logprobs(item):
                            events.append(_sse(reply.chunk_of(item)))
                if events:
                    yield "".join(events)
            if reply.error:
                yield _sse(error_body(reply.error, None, reply.error_status()[1]))
            if include_usage:
                yield _sse({**reply.chunk_base(), "choices": [], "usage": reply.usage()})
            yield "data: [DONE]\n\n"
        finally:
            if reply.pending:  # the client went away: free its KV blocks now
                aengine.abort(list(reply.pending))

    return app


# How often a non-streaming handler with nothing to send checks that its client is still there.
DISCONNECT_POLL_S = 0.5


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
