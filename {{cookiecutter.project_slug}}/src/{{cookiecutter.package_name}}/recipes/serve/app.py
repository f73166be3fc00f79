"""The HTTP routes (Starlette): `POST /generate` or `POST /classify`, `GET /health` and
`GET /info`, and for a language model the OpenAI-compatible ones (openai.py); a body read up to
its limit and checked, then handed to the batcher."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from . import openai
from .batching import Checked, Pending, Served
from .errors import BadRequest, JSONAnswer, stopped_event
from .settings import Settings

STREAM_TYPE = "application/x-ndjson"


def error_response(message: str, status: int) -> JSONAnswer:
    return JSONAnswer({"error": message}, status_code=status)


async def read_json(request: Request, settings: Settings) -> Any:
    limit = settings.request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body is more than this server's limit of {limit} bytes", 413)
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise BadRequest(f"the body is more than this server's limit of {limit} bytes", 413)

    reading = asyncio.ensure_future(read())
    done, _ = await asyncio.wait({reading}, timeout=settings.body_seconds)
    if not done:
        reading.cancel()
        raise BadRequest(
            f"the body took more than limits.body_seconds={settings.body_seconds:g}", 408
        )
    reading.result()  # the size limit's 413
    try:
        return json.loads(body)
    except RecursionError:
        raise BadRequest("the body nests deeper than JSON is read here") from None
    except ValueError as error:  # not UTF-8, not JSON, or a whole number too long for Python
        if "integer string conversion" in str(error):
            raise BadRequest("the body holds a number written with over 4300 characters") from None
        raise BadRequest(f"the body is not JSON ({error})") from None


def build_app(served: Served, settings: Settings, name: str = "model") -> Starlette:
    """The routes of `served`, a model called `name` (in the OpenAI-compatible answers)."""
    batcher = served.scheduler(settings)

    async def parse(body: Any) -> Checked:
        return await run_in_threadpool(served.parse, body)

    def start(checked: Checked, refuse: Any) -> Pending | Response:
        pending = Pending(checked.inputs, checked.options, asyncio.get_running_loop())
        if batcher.stopping.is_set() or batcher.draining.is_set():
            return refuse(stopped_event()["error"], 503)
        if not batcher.submit(pending):
            return refuse(
                f"{settings.queued_requests} requests are waiting already: send it again later",
                503,
            )
        return pending

    async def answer(request: Request) -> Response:
        try:
            body = await read_json(request, settings)
            checked = await parse(body)
        except BadRequest as error:
            return error_response(str(error), error.status)
        pending = start(checked, error_response)
        if isinstance(pending, Response):
            return pending
        if pending.options.get("stream"):
            return StreamingResponse(streamed(pending), media_type=STREAM_TYPE)
        event = await pending.final()
        if "error" in event:
            return error_response(event["error"], event["status"])
        return JSONAnswer(event)

    async def streamed(pending: Pending) -> AsyncIterator[str]:
        while True:
            event = await pending.events.get()
            if "error" in event:
                event = {"error": event["error"]}
            yield json.dumps(event) + "\n"
            if "text" not in event:
                return

    async def health(request: Request) -> Response:
        return JSONAnswer({"status": "ok", "model": served.kind})

    async def info(request: Request) -> Response:
        return JSONAnswer({
            "model": served.kind, "endpoint": f"POST {served.path}",
            "max_batch_size": settings.max_batch_size,
            "limits": {"request_bytes": settings.request_bytes,
                       "max_new_tokens": settings.most_new_tokens,
                       "image_pixels": settings.image_pixels},
            **served.info(),
        })  # fmt: skip

    async def submit(checked: Checked) -> Pending | Response:
        return start(checked, openai.error_response)

    completions = openai.Completions(name, parse, submit)

    def compatible(chat: bool) -> Any:
        async def route(request: Request) -> Response:
            try:
                body = await read_json(request, settings)
            except BadRequest as error:
                return openai.error_response(str(error), error.status)
            return await completions.answer(body, chat)

        return route

    language = served.kind == "language"
    compatible_routes = [
        Route("/v1/completions", compatible(chat=False), methods=["POST"]),
        Route("/v1/chat/completions", compatible(chat=True), methods=["POST"]),
        Route("/v1/models", completions.models, methods=["GET"]),
    ]

    async def other(request: Request, error: Exception) -> Response:
        status = error.status_code if isinstance(error, HTTPException) else 500
        also = ", POST /v1/completions, POST /v1/chat/completions" if language else ""
        return error_response(
            f"{request.method} {request.url.path} is not served here: this server has GET "
            f"/health, GET /info and POST {served.path}{also}",
            status,
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        batcher.thread.start()
        try:
            yield
        finally:
            batcher.stop()

    app = Starlette(
        routes=[
            Route(served.path, answer, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/info", info, methods=["GET"]),
            *(compatible_routes if language else []),
        ],
        exception_handlers={404: other, 405: other},
        lifespan=lifespan,
    )
    app.state.scheduler = batcher
    return app
