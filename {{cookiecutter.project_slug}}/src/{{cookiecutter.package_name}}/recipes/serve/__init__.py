"""The serve recipe: a trained model answering HTTP requests.

Language models continue prompts (`POST /generate`, streamed as NDJSON lines with
`"stream": true`, and OpenAI's `POST /v1/completions` and `POST /v1/chat/completions`, streamed as
server-sent events: openai.py); image classifiers give the top-k classes of an image (`POST /classify`).
Requests that arrive together run as one batch: prompts of different lengths left-padded, each
row getting what it gets alone and ending at its own `max_new_tokens` or end-of-text token.
Each request is checked on its own (a bad one gets a 4xx and one JSON line) before it joins a
batch, so it never fails the others.

Starlette and uvicorn in this one process, not LitServe: with litserve 0.2.19 one bad request
failed the others batched with it, a bad streamed request got 200 and an empty body, a body that
is not JSON got 500, and SIGTERM left four of its processes running."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import torch
import uvicorn
from omegaconf import DictConfig

from ...checkpointing.trained import rebuild
from ...run import lock as run_lock
from ...run.machine import configure_matmul_precision, use_hydra_logging_only
from ...run.settings import check_switches
from ...targets import allow
from .app import build_app
from .batching import Served
from .classification import Classification
from .generation import Generation
from .server import Server, guarded_protocol, hold_repeats, listening_socket, url_of
from .settings import Settings, check_settings, resolve_device

log = logging.getLogger(__name__)
# After a drain (server.py), what uvicorn gives the connections left to close.
GRACE_SECONDS = 5


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


def model_name(checkpoint: Path) -> str:
    """The run's name for a checkpoint in a run's `checkpoints/` folder, else the file's stem."""
    if checkpoint.parent.name == "checkpoints" and checkpoint.parent.parent.name:
        return checkpoint.parent.parent.name
    return checkpoint.stem


def serve_checkpoint(
    cfg: DictConfig, settings: Settings, device: torch.device, listener: socket.socket
) -> None:
    use_hydra_logging_only()
    configure_matmul_precision(cfg.get("matmul_precision"))
    trained = rebuild(cfg.ckpt_path, cfg.trust_checkpoint, cfg.data, cfg.model)
    served: Served
    if callable(getattr(getattr(trained.model, "net", None), "generate", None)):
        seed = cfg.get("seed")
        served = Generation(trained, settings, device, None if seed is None else int(seed))
    else:
        served = Classification(trained, settings, device)
    log.info("Loaded %s (%s model) on %s", trained.path, served.kind, device)
    app = build_app(served, settings, model_name(Path(trained.path)))
    config = uvicorn.Config(
        app, log_config=None, lifespan="on",
        http=guarded_protocol(settings.connections, settings.header_seconds),
        timeout_graceful_shutdown=GRACE_SECONDS,
    )  # fmt: skip
    hold_repeats()
    server = Server(config)
    server.url = url_of(listener)
    server.scheduler, server.shutdown_timeout = app.state.scheduler, settings.shutdown_timeout
    server.run(sockets=[listener])
    if server.stopped_by:
        log.info("Stopped by %s", server.stopped_by)
