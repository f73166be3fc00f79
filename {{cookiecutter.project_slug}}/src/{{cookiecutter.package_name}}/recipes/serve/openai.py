"""OpenAI-compatible routes for a language model: `POST /v1/completions`, `POST
/v1/chat/completions` (streamed as server-sent events with `"stream": true`, ending in `data:
[DONE]`) and `GET /v1/models`, so that clients written for OpenAI's API (its Python package,
LangChain, curl scripts) work unchanged with `base_url=<this server>/v1`.

Each request is translated into this server's own (`prompt` or `messages`, `max_new_tokens`,
`temperature`, `top_k`, `stream`) and checked and batched as those are; the answer is translated
back. Fields of OpenAI's API that change what is generated and that this server does not do
(`n` above 1, `top_p` below 1, penalties, `logit_bias`, `logprobs`, `echo`, stop strings) are
refused with a 400 rather than ignored, unless they hold their neutral value; `model` may name any
model (this server has one), `user` and `seed` are read and not used (sampling draws from the
server's own generator)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .batching import Checked, Pending
from .errors import BadRequest, JSONAnswer, shown

SUPPORTED = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_k", "stream")
# Fields that OpenAI's clients send, accepted only at the value that changes nothing.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "top_p": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False, None),
    "stop": (None, [], ""),
    "best_of": (1, None),
    "suffix": (None, ""),
    "stream_options": (None,),
}
IGNORED = ("user", "seed")
FINISH_REASONS = {"end": "stop", "length": "length"}
STREAM_TYPE = "text/event-stream"

# Starts a checked request and returns its pending answer, or the response that refuses it.
Submit = Callable[[Checked], Awaitable["Pending | Response"]]


def error_response(message: str, status: int) -> JSONAnswer:
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": kind, "param": None, "code": None}
    return JSONAnswer({"error": error}, status_code=status)


def translated(body: Any, chat: bool) -> dict[str, Any]:
    """This server's request for an OpenAI one."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    required = "messages" if chat else "prompt"
    known = {required, *SUPPORTED, *NEUTRAL, *IGNORED}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(
            f"unknown field(s) {', '.join(shown(key)[1:-1] for key in unknown)}: this server "
            f"reads {', '.join((required, *SUPPORTED))}"
        )
    for key, neutral in NEUTRAL.items():
        if key in body and not any(
            body[key] == value and type(body[key]) is type(value) for value in neutral
        ):
            raise BadRequest(f"{key}={shown(body[key])} is not supported by this server")
    if required not in body:
        raise BadRequest(f"{required} is missing")
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("model must be a string")
    ours: dict[str, Any] = {required: body[required]}
    if not chat and isinstance(ours["prompt"], list):
        if len(ours["prompt"]) != 1:
            raise BadRequest("send one prompt a request: a string, or a list of one string")
        ours["prompt"] = ours["prompt"][0]
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise BadRequest("give max_tokens or max_completion_tokens, not both")
    for theirs, mine in (("max_tokens", "max_new_tokens"), ("max_completion_tokens",
                         "max_new_tokens"), ("temperature", "temperature"), ("top_k", "top_k"),
                         ("stream", "stream")):  # fmt: skip
        if theirs in body and body[theirs] is not None:
            ours[mine] = body[theirs]
    return ours


class Completions:
    """The two routes' answers, for a model called `name`."""

    def __init__(self, name: str, parse: Callable[[Any], Awaitable[Checked]], submit: Submit):
        self.name = name
        self.parse = parse
        self.submit = submit

    async def answer(self, body: Any, chat: bool) -> Response:
        try:
            checked = await self.parse(translated(body, chat))
        except BadRequest as error:
            return error_response(str(error), error.status)
        started = await self.submit(checked)
        if isinstance(started, Response):
            return started
        identity = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {
            "id": identity,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.name,
        }
        prompt_tokens = len(checked.inputs)
        if checked.options.get("stream"):
            chunks = self.chunks(started, head, chat)
            return StreamingResponse(chunks, media_type=STREAM_TYPE)
        event = await started.final()
        if "error" in event:
            return error_response(event["error"], event["status"])
        text = event["completion"]
        reason = FINISH_REASONS.get(event["finish_reason"], event["finish_reason"])
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": event["tokens"],
                 "total_tokens": prompt_tokens + event["tokens"]}  # fmt: skip
        return JSONAnswer({**head, "choices": [choice], "usage": usage})

    async def chunks(
        self, pending: Pending, head: dict[str, Any], chat: bool
    ) -> AsyncIterator[str]:
        kind = {"object": "chat.completion.chunk"} if chat else {}

        def chunk(text: str | None, reason: str | None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
            if chat:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice.update(text=text or "", logprobs=None)
            return f"data: {json.dumps({**head, **kind, 'choices': [choice]})}\n\n"

        if chat:
            opening = {"index": 0, "delta": {"role": "assistant", "content": ""},
                       "finish_reason": None}  # fmt: skip
            yield f"data: {json.dumps({**head, **kind, 'choices': [opening]})}\n\n"
        while True:
            event = await pending.events.get()
            if "error" in event:
                error = {"message": event["error"], "type": "server_error", "param": None,
                         "code": None}  # fmt: skip
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            if "text" in event:
                yield chunk(event["text"], None)
                continue
            reason = FINISH_REASONS.get(event["finish_reason"], event["finish_reason"])
            yield chunk(None, reason)
            yield "data: [DONE]\n\n"
            return

    async def models(self, request: Request) -> Response:
        return JSONAnswer({
            "object": "list",
            "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "local"}],
        })  # fmt: skip
