"""One thread runs the model, taking the checked requests that wait and answering each through its
own queue of events: an image classifier's requests that arrive together run as one batch
(`Batcher`); a language model's join and leave its running batch between decode steps
(continuous.py)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .errors import Stopping, stopped_event
from .settings import Settings

log = logging.getLogger(__package__)  # the serve command's one logger, whichever module logs


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
    answered: threading.Event = field(default_factory=threading.Event)

    def send(self, event: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        if "text" not in event:
            self.answered.set()

    async def final(self) -> dict[str, Any]:
        while True:
            event = await self.events.get()
            if "text" not in event:
                return event


class Served(Protocol):
    """A model behind the server (`Generation` or `Classification`): it checks a request and
    makes the scheduler that runs the checked ones."""

    kind: str
    path: str

    def parse(self, body: Any) -> Checked: ...

    def scheduler(self, settings: Settings) -> Scheduler: ...

    def info(self) -> dict[str, Any]: ...


class Grouped(Protocol):
    """A model whose requests run in batches: it groups those that can run together and runs a
    group."""

    def groups(self, batch: list[Pending]) -> list[list[Pending]]: ...

    def run(self, group: list[Pending], stopping: threading.Event) -> None: ...


class Scheduler:
    """The queue of checked requests and the thread that runs the model on them (`loop`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.waiting: queue.Queue[Pending] = queue.Queue(maxsize=settings.queued_requests)
        self.stopping = threading.Event()
        self.draining = threading.Event()  # a stop signal came: no new request is taken
        self.submitted: list[Pending] = []  # by the server's event loop, which alone reads it
        self.thread = threading.Thread(target=self.loop, name="batcher", daemon=True)

    def submit(self, pending: Pending) -> bool:
        try:
            self.waiting.put_nowait(pending)
        except queue.Full:
            return False
        self.submitted = [*(p for p in self.submitted if not p.answered.is_set()), pending]
        return True

    def unanswered(self) -> int:
        self.submitted = [p for p in self.submitted if not p.answered.is_set()]
        return len(self.submitted)

    def loop(self) -> None:
        raise NotImplementedError

    def answer_the_waiting(self) -> None:
        """What still waits when the server stops."""
        while True:
            try:
                self.waiting.get_nowait().send(stopped_event())
            except queue.Empty:
                return

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)


class Batcher(Scheduler):
    """A request that finds the model idle runs at once, with whatever else is already waiting;
    while it is busy, requests queue, and the next batch waits up to `batch_timeout` after its
    first for more (up to `max_batch_size`): waiting pays only when requests keep arriving."""

    def __init__(self, served: Grouped, settings: Settings) -> None:
        super().__init__(settings)
        self.served = served

    def next_batch(self) -> list[Pending]:
        try:
            batch, wait = [self.waiting.get_nowait()], self.settings.batch_timeout
        except queue.Empty:
            try:
                batch, wait = [self.waiting.get(timeout=0.1)], 0.0
            except queue.Empty:
                return []
        deadline = time.monotonic() + wait
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
        self.answer_the_waiting()

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
