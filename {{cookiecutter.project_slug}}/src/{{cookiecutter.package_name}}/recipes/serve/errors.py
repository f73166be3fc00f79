"""What a request can get wrong, and what the server answers when it stops: a bad request gets
a 4xx and one JSON line, checked on its own before it joins a batch."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class JSONAnswer(JSONResponse):
    """Every answer's body: one line of ASCII JSON, so that whatever a request held and an
    answer repeats (a lone surrogate such as "\\ud800" among them) is written as an escape."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Stopping(Exception):
    """The server is stopping: requests not yet answered get 503."""


def shown(value: Any, most: int = 40) -> str:
    """`value` as JSON, cut short: messages stay short whatever a request holds."""
    text = json.dumps(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def fields(body: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object, e.g. " + json.dumps({required[0]: "..."}))
    unknown = sorted(set(body) - {*required, *optional})
    if unknown:
        raise BadRequest(
            f"unknown field(s) {', '.join(shown(key)[1:-1] for key in unknown)}: use "
            f"{', '.join((*required, *optional))}"
        )
    missing = [key for key in required if key not in body]
    if missing:
        raise BadRequest(f"{missing[0]} is missing")
    return body


def whole_field(
    body: dict[str, Any], key: str, default: Any, low: int, high: int | None, nullable: bool = False
) -> Any:
    value = body.get(key, default)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadRequest(f"{key}={shown(value)}: use a whole number of {low} or more")
    if high is not None and value > high:
        raise BadRequest(f"{key}={value} is more than this server's limit of {high}")
    return value


def stopped_event() -> dict[str, Any]:
    return {"error": "the server is stopping: send the request again later", "status": 503}
