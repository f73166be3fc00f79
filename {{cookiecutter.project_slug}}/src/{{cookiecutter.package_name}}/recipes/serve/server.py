"""Where the server listens: its socket, bound before the model loads; uvicorn's server, which a
stop signal drains (running requests finish, new ones get 503) and ends with exit code 0; and the
HTTP protocol that bounds what one client can hold: open connections, and the time a request's
headers may take."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...errors import ConfigError
from .batching import Scheduler

log = logging.getLogger(__package__)  # the serve command's one logger, whichever module logs


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: an address in use is refused at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise ConfigError(
            f"host={host} is not an address ({error.strerror}): use e.g. 127.0.0.1 or 0.0.0.0."
        ) from error
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        reason = error.strerror or str(error)
        raise ConfigError(
            f"cannot listen on {host} port {port} ({reason}): pick another port=..., or port=0 "
            "for a free one."
        ) from error
    return listener


class Server(uvicorn.Server):
    """uvicorn's server. A stop signal drains it: new requests get 503, running ones get
    `shutdown_timeout` seconds to finish, then the scheduler ends those left (a stream's last
    line says the server is stopping) and uvicorn shuts down; exit code 0, the signal named in
    the log. A second signal stops it at once."""

    url = ""
    stopped_by: str | None = None
    scheduler: Scheduler | None = None
    shutdown_timeout = 0.0
    draining: asyncio.Future[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()

        def stop(number: int, frame: FrameType | None) -> None:
            if self.stopped_by is None and self.scheduler is not None and self.started:
                self.stopped_by = signal.Signals(number).name
                loop.call_soon_threadsafe(self.start_draining)
                return
            self.stopped_by = self.stopped_by or signal.Signals(number).name
            self.handle_exit(number, frame)

        handled = (signal.SIGINT, signal.SIGTERM)
        before = {number: signal.signal(number, stop) for number in handled}
        try:
            yield
        finally:
            for number, handler in before.items():
                signal.signal(number, handler)

    def start_draining(self) -> None:
        self.draining = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        assert self.scheduler is not None
        scheduler = self.scheduler
        scheduler.draining.set()
        log.info(
            "%s: finishing %d request(s) within %g s; new ones get 503", self.stopped_by,
            scheduler.unanswered(), self.shutdown_timeout,
        )  # fmt: skip
        deadline = time.monotonic() + self.shutdown_timeout
        while scheduler.unanswered() and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        scheduler.stopping.set()  # what still runs ends with the stopping line
        deadline = time.monotonic() + 5
        while scheduler.unanswered() and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # the last lines leave before the connections close
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("Serving at %s (stop with Ctrl-C or SIGTERM)", self.url)


class RepeatsHeld(logging.Filter):
    """A warning that hostile or broken clients can cause once a request (uvicorn's "Invalid HTTP
    request received.") is logged the first time, then at most once every `seconds` with how
    many like it were held back: the log does not grow with each attempt."""

    def __init__(self, seconds: float = 60.0) -> None:
        super().__init__()
        self.seconds = seconds
        self.last: dict[str, float] = {}
        self.held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key, now = str(record.msg), time.monotonic()
        if key in self.last and now - self.last[key] < self.seconds:
            self.held[key] = self.held.get(key, 0) + 1
            return False
        self.last[key] = now
        held = self.held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last {self.seconds:g} s)"
        return True


def hold_repeats() -> None:
    """RepeatsHeld on uvicorn's own logger, once."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, RepeatsHeld) for f in logger.filters):
        logger.addFilter(RepeatsHeld())


def refusal(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP response that closes the connection: one JSON line."""
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(connections: int, header_seconds: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, bounded: a connection beyond `connections` open at once gets
    a 503 and is closed before anything of it is read, so the process never runs out of file
    descriptors (refusals are logged once); a request whose headers have not all arrived
    `header_seconds` after its first byte (or after the connection opened) gets a 408."""
    logged = {"refused": False}

    class Guarded(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None
        timed_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > connections:
                if not logged["refused"]:
                    logged["refused"] = True
                    log.warning(
                        "%d connections are open: those beyond limits.connections=%d get 503 "
                        "(logged once)", len(self.connections) - 1, connections,
                    )  # fmt: skip
                self.close_with(503, "Service Unavailable", "too many connections are open: "
                                "send the request again later")  # fmt: skip
                return
            self.expect_headers()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self.expect_headers()
            super().data_received(data)

        def expect_headers(self) -> None:
            """Times the request whose headers come next (the cycle it will replace)."""
            if self.header_timer is not None and self.timed_cycle is self.cycle:
                return
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.timed_cycle = self.cycle
            self.header_timer = self.loop.call_later(header_seconds, self.headers_late)

        def headers_late(self) -> None:
            self.header_timer = None
            if self.cycle is self.timed_cycle and not self.transport.is_closing():
                self.close_with(408, "Request Timeout", f"the request's headers took more "
                                f"than limits.header_seconds={header_seconds:g}")  # fmt: skip

        def close_with(self, status: int, reason: str, message: str) -> None:
            self.transport.write(refusal(status, reason, message))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

    return Guarded


def url_of(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
