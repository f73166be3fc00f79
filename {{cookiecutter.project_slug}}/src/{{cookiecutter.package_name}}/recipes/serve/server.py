"""Where the server listens: its socket, bound before the model loads, and uvicorn's server,
which a stop signal ends with exit code 0."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from types import FrameType

import uvicorn

from ...errors import ConfigError

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
    """uvicorn's server; a stop signal ends it with exit code 0 (uvicorn raises the signal
    again once it has shut down) and is named in the log."""

    url = ""
    stopped_by: str | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def stop(number: int, frame: FrameType | None) -> None:
            self.stopped_by = self.stopped_by or signal.Signals(number).name
            self.handle_exit(number, frame)

        handled = (signal.SIGINT, signal.SIGTERM)
        before = {number: signal.signal(number, stop) for number in handled}
        try:
            yield
        finally:
            for number, handler in before.items():
                signal.signal(number, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("Serving at %s (stop with Ctrl-C or SIGTERM)", self.url)


def url_of(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
