"""The serve recipe: a trained model answering HTTP requests.

Language models continue prompts (`POST /generate`, streamed as NDJSON lines with
`"stream": true`); image classifiers give the top-k classes of an image (`POST /classify`).
Requests that arrive together run as one batch: prompts of different lengths left-padded, each
row getting what it gets alone and ending at its own `max_new_tokens` or end-of-text token.
Each request is checked on its own (a bad one gets a 4xx and one JSON line) before it joins a
batch, so it never fails the others.

Starlette and uvicorn in this one process, not LitServe: with litserve 0.2.19 one bad request
failed the others batched with it, a bad streamed request got 200 and an empty body, a body that
is not JSON got 500, and SIGTERM left four of its processes running."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import math
import queue
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import uvicorn
from omegaconf import DictConfig
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..checkpointing.trained import Trained, rebuild, text_interface
from ..errors import ConfigError
from ..run import lock as run_lock
from ..run.machine import configure_matmul_precision, use_hydra_logging_only
from ..run.settings import check_switches, check_whole, number
from ..targets import allow

log = logging.getLogger(__name__)

STREAM_TYPE = "application/x-ndjson"


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    max_batch_size: int
    batch_timeout: float
    shutdown_timeout: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_k_classes: int
    request_bytes: int
    most_new_tokens: int
    image_pixels: int
    queued_requests: int


def check_seconds(key: str, value: Any) -> float:
    if not number(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key}={value!r}: use a number of seconds, 0 or more (e.g. 0.01).")
    return float(value)


def check_temperature(value: Any) -> str | None:
    """What is wrong with `value` as a temperature, or None."""
    if not number(value) or not math.isfinite(value) or value < 0:
        return "use a finite number, 0 (greedy) or more"
    return None


def check_settings(cfg: DictConfig) -> Settings:
    """Every setting, before the checkpoint is read."""
    host = cfg.host
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"host={host!r}: give an address, e.g. 127.0.0.1 or 0.0.0.0.")
    check_whole("port", cfg.port, 0, allowed=())
    if cfg.port > 65535:
        raise ConfigError(f"port={cfg.port}: use 1 to 65535, or 0 for a free port.")
    check_whole("max_batch_size", cfg.max_batch_size, 1, allowed=())
    check_whole("shutdown_timeout", cfg.shutdown_timeout, 0, allowed=())
    limits = cfg.limits
    for key in ("request_bytes", "max_new_tokens", "image_pixels", "queued_requests"):
        check_whole(f"limits.{key}", limits.get(key), 1, allowed=())
    check_whole("max_new_tokens", cfg.max_new_tokens, 1, allowed=())
    if cfg.max_new_tokens > limits.max_new_tokens:
        raise ConfigError(
            f"max_new_tokens={cfg.max_new_tokens} is more than limits.max_new_tokens="
            f"{limits.max_new_tokens}: lower it, or raise the limit."
        )
    problem = check_temperature(cfg.temperature)
    if problem:
        raise ConfigError(f"temperature={cfg.temperature!r}: {problem}.")
    check_whole("top_k", cfg.top_k, 1)
    check_whole("top_k_classes", cfg.top_k_classes, 1, allowed=())
    return Settings(
        host=host.strip(), port=int(cfg.port), max_batch_size=int(cfg.max_batch_size),
        batch_timeout=check_seconds("batch_timeout", cfg.batch_timeout),
        shutdown_timeout=int(cfg.shutdown_timeout),
        max_new_tokens=int(cfg.max_new_tokens), temperature=float(cfg.temperature),
        top_k=None if cfg.top_k is None else int(cfg.top_k),
        top_k_classes=int(cfg.top_k_classes), request_bytes=int(limits.request_bytes),
        most_new_tokens=int(limits.max_new_tokens), image_pixels=int(limits.image_pixels),
        queued_requests=int(limits.queued_requests),
    )  # fmt: skip


def resolve_device(requested: Any) -> torch.device:
    name = str(requested).strip()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={requested!r}: use auto, cpu, cuda or cuda:<index>.")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if (device.index is not None and device.index >= count) or count == 0:
            raise ConfigError(
                f"device={requested} but this machine has {count} usable GPU(s): use "
                f"{'cuda:0 to cuda:' + str(count - 1) if count else 'cpu'}, or device=auto."
            )
    return device


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


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Stopping(Exception):
    """The server is stopping: requests not yet answered get 503."""


@dataclass
class Checked:
    """A request that passed every check: the model's inputs and how to answer."""

    inputs: torch.Tensor
    options: dict[str, Any]


@dataclass
class Pending:
    """A checked request waiting for the model, and the events that answer it."""

    inputs: torch.Tensor
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)

    def send(self, event: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def final(self) -> dict[str, Any]:
        while True:
            event = await self.events.get()
            if "text" not in event:
                return event


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


class Generation:
    """A language model: prompts in, continuations out."""

    kind = "language"
    path = "/generate"

    def __init__(
        self, trained: Trained, settings: Settings, device: torch.device, seed: int | None
    ) -> None:
        model: Any = trained.model
        self.net = model.net.to(device).eval()
        self.device = device
        self.settings = settings
        text = text_interface(trained.datamodule)
        self.encode, self.decode, self.chat = text.encode, text.decode, text.chat
        self.encode("a")  # loads the tokenizer now: one that cannot be read fails the command
        self.stop_token = text.end_of_text
        self.generator = torch.Generator(device)
        if seed is not None:
            self.generator.manual_seed(seed)

    def parse(self, body: Any) -> Checked:
        keys = ("max_new_tokens", "temperature", "top_k", "stream")
        if isinstance(body, dict) and "messages" in body:
            body = fields(body, ("messages",), keys)
            tokens = self.chat_tokens(body["messages"])
        else:
            body = fields(body, ("prompt",), ("messages", *keys))
            tokens = self.prompt_tokens(body["prompt"])
        settings = self.settings
        options = {
            "max_new_tokens": whole_field(
                body, "max_new_tokens", settings.max_new_tokens, 1, settings.most_new_tokens
            ),
            "top_k": whole_field(body, "top_k", settings.top_k, 1, None, nullable=True),
            "temperature": body.get("temperature", settings.temperature),
            "stream": body.get("stream", False),
        }
        problem = check_temperature(options["temperature"])
        if problem:
            raise BadRequest(f"temperature={shown(options['temperature'])}: {problem}")
        if not isinstance(options["stream"], bool):
            raise BadRequest(f"stream={shown(options['stream'])}: use true or false")
        block_size = int(self.net.block_size)
        if len(tokens) > block_size:
            what = "the conversation" if "messages" in body else "prompt"
            raise BadRequest(
                f"{what} is {len(tokens)} tokens long, more than the model's context of "
                f"{block_size}: shorten it"
            )
        options["temperature"] = float(options["temperature"])
        return Checked(torch.tensor(tokens, dtype=torch.long), options)

    def prompt_tokens(self, prompt: Any) -> list[int]:
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        if not prompt:
            raise BadRequest("prompt is empty: give at least one character")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise BadRequest(f"prompt is not valid Unicode ({error.reason})") from error
        return self.encode(prompt)

    def chat_tokens(self, messages: Any) -> list[int]:
        """A conversation in the template the model was trained on (instruction data only)."""
        if self.chat is None:
            raise BadRequest(
                "this model was not trained on instructions (data=instructions), so it has no "
                "chat template: send a prompt instead of messages"
            )
        try:
            json.dumps(messages, ensure_ascii=False).encode("utf-8")
            return self.chat(messages)
        except UnicodeEncodeError as error:
            raise BadRequest(f"messages are not valid Unicode ({error.reason})") from error
        except ValueError as error:
            raise BadRequest(str(error)) from error

    def groups(self, batch: list[Pending]) -> list[list[Pending]]:
        """Requests that sample alike run together (greedy ones whatever their top_k)."""
        groups: dict[tuple[float, int | None], list[Pending]] = {}
        for pending in batch:
            temperature = pending.options["temperature"]
            key = (temperature, pending.options["top_k"] if temperature else None)
            groups.setdefault(key, []).append(pending)
        return list(groups.values())

    def run(self, group: list[Pending], stopping: threading.Event) -> None:
        longest = max(len(pending.inputs) for pending in group)
        idx = torch.zeros(len(group), longest, dtype=torch.long)
        real = torch.zeros(len(group), longest, dtype=torch.bool)
        for row, pending in enumerate(group):
            idx[row, longest - len(pending.inputs) :] = pending.inputs
            real[row, longest - len(pending.inputs) :] = True
        rows = [Continuation(pending, self.decode, len(group)) for pending in group]

        def on_token(tokens: torch.Tensor) -> None:
            if stopping.is_set():
                raise Stopping
            for row, token in zip(rows, tokens[:, 0].tolist(), strict=True):
                row.take(token, self.stop_token)

        options = group[0].options
        self.net.generate(
            idx.to(self.device), [row.limit for row in rows], temperature=options["temperature"],
            top_k=options["top_k"], generator=self.generator, on_token=on_token,
            padding_mask=real.to(self.device), stop_token=self.stop_token,
        )  # fmt: skip

    def info(self) -> dict[str, Any]:
        settings = self.settings
        return {
            "context": int(self.net.block_size),
            "defaults": {"max_new_tokens": settings.max_new_tokens,
                         "temperature": settings.temperature, "top_k": settings.top_k},
        }  # fmt: skip


class Continuation:
    """One row of a batch: its tokens as they come, its text streamed where asked, its answer
    once it ends. A character split over tokens waits for the rest."""

    def __init__(self, pending: Pending, decode: Callable[[list[int]], str], batch: int) -> None:
        self.pending = pending
        self.decode = decode
        self.batch = batch
        self.limit = int(pending.options["max_new_tokens"])
        self.stream = bool(pending.options["stream"])
        self.tokens: list[int] = []
        self.sent = 0
        self.ended = False

    def take(self, token: int, stop_token: int | None) -> None:
        if self.ended:
            return
        if token == stop_token:
            self.finish("end")
            return
        self.tokens.append(token)
        if self.stream:
            text = self.decode(self.tokens)
            if not text.endswith("\ufffd"):
                self.send_text(text)
        if len(self.tokens) >= self.limit:
            self.finish("length")

    def send_text(self, text: str) -> None:
        if len(text) > self.sent:
            self.pending.send({"text": text[self.sent :]})
            self.sent = len(text)

    def finish(self, reason: str) -> None:
        self.ended = True
        text = self.decode(self.tokens)
        answer: dict[str, Any] = {"tokens": len(self.tokens), "finish_reason": reason,
                                  "batch_size": self.batch}  # fmt: skip
        if self.stream:
            self.send_text(text)
            self.pending.send({"done": True, **answer})
        else:
            self.pending.send({"completion": text, **answer})


class RequestImage(io.BytesIO):
    """An uploaded image file, named so in the data module's messages."""

    def __str__(self) -> str:
        return "the image"


class Classification:
    """An image classifier: an image file in, its top-k classes out."""

    kind = "image"
    path = "/classify"

    def __init__(self, trained: Trained, settings: Settings, device: torch.device) -> None:
        self.model: Any = trained.model.to(device).eval()
        self.datamodule: Any = trained.datamodule
        self.device = device
        self.settings = settings
        names = getattr(self.datamodule, "classes", None)
        self.names = [str(name) for name in names] if isinstance(names, (list, tuple)) else None

    def parse(self, body: Any) -> Checked:
        body = fields(body, ("image",), ("top_k",))
        encoded = body["image"]
        if not isinstance(encoded, str):
            raise BadRequest("image must be a string: the image file in base64")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as error:
            raise BadRequest(f"image is not base64 ({error})") from error
        top_k = whole_field(body, "top_k", self.settings.top_k_classes, 1, None)
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as opened:
                width, height = opened.size
        except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError, ...
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise BadRequest(
                f"image does not decode ({reason}): send a PNG or JPEG file"
            ) from error
        if width * height > self.settings.image_pixels:
            raise BadRequest(
                f"image is {width}x{height} pixels, more than this server's limit of "
                f"{self.settings.image_pixels}",
                413,
            )
        try:
            images = self.datamodule.images_from_files([RequestImage(data)])
        except ConfigError as error:
            raise BadRequest(f"image does not decode: {error}") from error
        return Checked(images, {"top_k": top_k})

    def groups(self, batch: list[Pending]) -> list[list[Pending]]:
        return [batch]

    def run(self, group: list[Pending], stopping: threading.Event) -> None:
        images = torch.cat([pending.inputs for pending in group]).to(self.device)
        labels = torch.full((len(group),), -1, device=self.device)
        batch = self.datamodule.on_after_batch_transfer((images, labels), 0)
        probabilities = self.model.predict_step(batch, 0).float().cpu()
        most = min(max(pending.options["top_k"] for pending in group), probabilities.size(1))
        top = probabilities.topk(most, dim=1)
        for pending, classes, chances in zip(
            group, top.indices.tolist(), top.values.tolist(), strict=True
        ):
            count = pending.options["top_k"]
            answer = [{"class": c, "probability": p} for c, p in zip(classes, chances, strict=True)]
            if self.names and len(self.names) == probabilities.size(1):
                for item in answer:
                    item["name"] = self.names[item["class"]]
            pending.send({"classes": answer[:count], "batch_size": len(group)})

    def info(self) -> dict[str, Any]:
        defaults = {"top_k": self.settings.top_k_classes}
        return {"defaults": defaults}


Served = Generation | Classification


class Batcher:
    """One thread runs the model: it takes the first waiting request, waits up to
    `batch_timeout` for more (up to `max_batch_size`), and runs them as one batch."""

    def __init__(self, served: Served, settings: Settings) -> None:
        self.served = served
        self.settings = settings
        self.waiting: queue.Queue[Pending] = queue.Queue(maxsize=settings.queued_requests)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="batcher", daemon=True)

    def submit(self, pending: Pending) -> bool:
        try:
            self.waiting.put_nowait(pending)
        except queue.Full:
            return False
        return True

    def next_batch(self) -> list[Pending]:
        try:
            batch = [self.waiting.get(timeout=0.1)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.settings.batch_timeout
        while len(batch) < self.settings.max_batch_size:
            left = deadline - time.monotonic()
            try:
                batch.append(
                    self.waiting.get(timeout=left) if left > 0 else self.waiting.get_nowait()
                )
            except queue.Empty:
                break
        return batch

    def loop(self) -> None:
        with torch.inference_mode():
            while not self.stopping.is_set():
                batch = self.next_batch()
                for group in self.served.groups(batch) if batch else []:
                    self.run(group)
        while True:  # what still waits when the server stops
            try:
                self.waiting.get_nowait().send(stopped_event())
            except queue.Empty:
                return

    def run(self, group: list[Pending]) -> None:
        log.debug("A batch of %d request(s)", len(group))
        try:
            if self.stopping.is_set():
                raise Stopping
            self.served.run(group, self.stopping)
        except Stopping:
            for pending in group:
                pending.send(stopped_event())
        except Exception:
            log.exception("The model failed on a batch of %d request(s)", len(group))
            for pending in group:
                pending.send({"error": "the model failed on this request (see the server's log)",
                              "status": 500})  # fmt: skip

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)


def stopped_event() -> dict[str, Any]:
    return {"error": "the server is stopping: send the request again later", "status": 503}


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body is more than this server's limit of {limit} bytes", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadRequest(f"the body is more than this server's limit of {limit} bytes", 413)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the body is not JSON ({error})") from error
    except RecursionError:
        raise BadRequest("the body nests deeper than JSON is read here") from None


def build_app(served: Served, settings: Settings) -> Starlette:
    batcher = Batcher(served, settings)

    async def answer(request: Request) -> Response:
        try:
            body = await read_json(request, settings.request_bytes)
            checked = await run_in_threadpool(served.parse, body)
        except BadRequest as error:
            return error_response(str(error), error.status)
        pending = Pending(checked.inputs, checked.options, asyncio.get_running_loop())
        if batcher.stopping.is_set():
            return error_response(stopped_event()["error"], 503)
        if not batcher.submit(pending):
            return error_response(
                f"{settings.queued_requests} requests are waiting already: send it again later",
                503,
            )
        if pending.options.get("stream"):
            return StreamingResponse(streamed(pending), media_type=STREAM_TYPE)
        event = await pending.final()
        if "error" in event:
            return error_response(event["error"], event["status"])
        return JSONResponse(event)

    async def streamed(pending: Pending) -> AsyncIterator[str]:
        while True:
            event = await pending.events.get()
            if "error" in event:
                event = {"error": event["error"]}
            yield json.dumps(event) + "\n"
            if "text" not in event:
                return

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": served.kind})

    async def info(request: Request) -> Response:
        return JSONResponse({
            "model": served.kind, "endpoint": f"POST {served.path}",
            "max_batch_size": settings.max_batch_size, "batch_timeout": settings.batch_timeout,
            "limits": {"request_bytes": settings.request_bytes,
                       "max_new_tokens": settings.most_new_tokens,
                       "image_pixels": settings.image_pixels},
            **served.info(),
        })  # fmt: skip

    async def other(request: Request, error: Exception) -> Response:
        status = error.status_code if isinstance(error, HTTPException) else 500
        return error_response(
            f"{request.method} {request.url.path} is not served here: this server has GET "
            f"/health, GET /info and POST {served.path}",
            status,
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        batcher.thread.start()
        try:
            yield
        finally:
            batcher.stop()

    return Starlette(
        routes=[
            Route(served.path, answer, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/info", info, methods=["GET"]),
        ],
        exception_handlers={404: other, 405: other},
        lifespan=lifespan,
    )


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


def serve(cfg: DictConfig) -> dict[str, float]:
    allow(cfg)
    check_switches(cfg)
    settings = check_settings(cfg)
    device = resolve_device(cfg.get("device", "auto"))
    with run_lock.hold(Path(cfg.paths.output_dir)):
        listener = listening_socket(settings.host, settings.port)
        try:
            serve_checkpoint(cfg, settings, device, listener)
        finally:
            listener.close()
    return {}


def serve_checkpoint(
    cfg: DictConfig, settings: Settings, device: torch.device, listener: socket.socket
) -> None:
    use_hydra_logging_only()
    configure_matmul_precision(cfg.get("matmul_precision"))
    trained = rebuild(cfg)
    served: Served
    if callable(getattr(getattr(trained.model, "net", None), "generate", None)):
        seed = cfg.get("seed")
        served = Generation(trained, settings, device, None if seed is None else int(seed))
    else:
        served = Classification(trained, settings, device)
    log.info("Loaded %s (%s model) on %s", trained.path, served.kind, device)
    config = uvicorn.Config(
        build_app(served, settings), log_config=None, lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )  # fmt: skip
    server = Server(config)
    server.url = url_of(listener)
    server.run(sockets=[listener])
    if server.stopped_by:
        log.info("Stopped by %s", server.stopped_by)


if __name__ == "__main__":  # `python -m <package>.recipes.serve` runs `<package>-serve`
    from .. import cli

    cli.serve()
