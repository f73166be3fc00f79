"""Continuous batching for a language model: each request holds a row of the running batch from
the step after it arrives until its own end, and the model runs one decode step for every row at
a time, so requests join and leave between steps instead of waiting for a batch to finish.

A joining request's prompt runs alone (its keys and values then copied into its row of the
cache); each row has its own length, sampling settings and end. The rows' cache has a fixed
shape (`max_batch_size` rows of the model's context), so with `compile_decode` every step replays
one compiled graph (CUDA graphs on a GPU). A row whose context fills up is refilled from its last
`block_size` tokens, alone, as `generate` refills its cache: each request gets the tokens it gets
alone (greedy: the model's own `generate`, tested)."""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass
from typing import Any

import torch

from ...models.nets.decoding import KVCache, compiled_step, sample
from .batching import Pending, Scheduler
from .errors import stopped_event
from .settings import Settings

log = logging.getLogger(__package__)

FAILED = {"error": "the model failed on this request (see the server's log)", "status": 500}


@dataclass
class Row:
    """A request holding a row of the batch: its tokens so far (prompt included), how many are
    in its row of the cache, and the most rows that ran with it in one step."""

    continuation: Any  # generation.Continuation
    tokens: list[int]
    temperature: float
    top_k: int | None
    cached: int = 0
    most_together: int = 1
    last: int = 0


class Rows:
    """The running batch: up to `size` rows, one decode step at a time. The rows running are
    always the cache's first ones (a row that ends takes the last one's place), so an
    uncompiled step runs on those alone; a compiled one runs on all `size`, at one shape."""

    def __init__(self, generation: Any, size: int, compiled: bool) -> None:
        self.generation = generation
        self.net = generation.net
        self.size = size
        self.compiled = compiled
        self.cache = KVCache(self.net.n_layer, self.net.block_size)
        self.rows: list[Row] = []

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return self.size - len(self.rows)

    def join(self, pending: Pending) -> None:
        """Run the request's prompt alone into the next row, and give it its first token."""
        options = pending.options
        continuation = self.generation.continuation(pending)
        row = Row(continuation, pending.inputs.tolist(), options["temperature"], options["top_k"])
        self.rows.append(row)
        try:
            self.refill(len(self.rows) - 1, row)
        except Exception:
            self.rows.remove(row)
            raise
        self.leave()

    def refill(self, slot: int, row: Row) -> None:
        """Run the row's last `block_size` tokens alone, keep their keys and values in its row
        and take the token they give."""
        window = row.tokens[-self.net.block_size :]
        alone = KVCache(self.net.n_layer, len(window))
        idx = torch.tensor([window], dtype=torch.long, device=self.generation.device)
        logits = self.net(idx, alone)
        self.cache.allocate_rows(self.size, alone)
        self.cache.store_row(slot, alone)
        row.cached = len(window)
        token = sample(logits[:, -1, :], row.temperature, row.top_k, self.generation.generator)
        self.take(row, int(token))

    def take(self, row: Row, token: int) -> None:
        row.continuation.batch = row.most_together
        row.continuation.take(token, self.generation.stop_token)
        row.tokens.append(token)
        row.last = token

    def leave(self) -> None:
        """Rows that ended leave; the last running rows move into their places."""
        slot = 0
        while slot < len(self.rows):
            if not self.rows[slot].continuation.ended:
                slot += 1
                continue
            last = len(self.rows) - 1
            if slot != last:
                self.cache.move_row(last, slot)
                self.rows[slot] = self.rows[last]
            self.rows.pop()

    def step(self) -> None:
        """One new token for every row: a decode step of the batch (each row at its own
        position), then each row's own sampling; a full row is refilled instead."""
        refilled = set()
        for slot, row in enumerate(self.rows):
            if row.cached >= self.net.block_size:
                self.refill(slot, row)
                refilled.add(slot)
        running = [(slot, row) for slot, row in enumerate(self.rows) if slot not in refilled]
        if running:
            self.decode(running)
        self.leave()

    def decode(self, running: list[tuple[int, Row]]) -> None:
        device = self.generation.device
        # Free rows, and rows refilled above (whose every next token is a refill too: their
        # cache rows are rewritten before being read), run a token 0 at column 0, unread.
        count = self.size if self.compiled else len(self.rows)
        last, cached = [0] * count, [0] * count
        for slot, row in running:
            last[slot], cached[slot] = row.last, row.cached
        tokens = torch.tensor(last, dtype=torch.long, device=device).unsqueeze(1)
        cache = self.cache if self.compiled else self.cache.first_rows(count)
        if not self.compiled and len(running) == count and len(set(cached)) == 1:
            # Rows of one length (a lone request): `generate`'s own step, over the positions
            # written so far and without a mask.
            cache.length = cached[0]
        else:
            cache.prepare_rows(torch.tensor(cached, dtype=torch.long, device=device))
        try:
            if self.compiled:
                if device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                logits = compiled_step(device.type)(self.net, tokens, cache)
            else:
                logits = self.net(tokens, cache)
        finally:
            cache.stepping = False
        logits = logits[:, -1, :]
        groups: dict[tuple[float, int | None], list[int]] = {}
        for slot, row in running:
            row.cached += 1
            row.most_together = max(row.most_together, len(running))
            key = (row.temperature, row.top_k if row.temperature else None)
            groups.setdefault(key, []).append(slot)
        chosen: dict[int, int] = {}
        for (temperature, top_k), slots in groups.items():
            picked = sample(logits[slots], temperature, top_k, self.generation.generator)
            chosen.update(zip(slots, picked[:, 0].tolist(), strict=True))
        for slot, row in running:
            self.take(row, chosen[slot])

    def end_all(self, event: dict[str, Any]) -> None:
        for row in self.rows:
            row.continuation.pending.send(event)
        self.rows.clear()


class ContinuousBatcher(Scheduler):
    """One thread runs the model: between decode steps, waiting requests take the free rows."""

    def __init__(self, generation: Any, settings: Settings) -> None:
        super().__init__(settings)
        self.generation = generation

    def loop(self) -> None:
        rows = Rows(self.generation, self.settings.max_batch_size, self.settings.compile_decode)
        with torch.inference_mode():
            while not self.stopping.is_set():
                self.admit(rows)
                if not rows.active:
                    continue
                try:
                    rows.step()
                except Exception:
                    log.exception("The model failed on a batch of %d request(s)", rows.active)
                    rows.end_all(FAILED)
            rows.end_all(stopped_event())
        self.answer_the_waiting()

    def admit(self, rows: Rows) -> None:
        """Waiting requests into free rows; with no row running, wait briefly for one."""
        while rows.free and not self.stopping.is_set():
            try:
                pending = (
                    self.waiting.get_nowait() if rows.active else self.waiting.get(timeout=0.1)
                )
            except queue.Empty:
                return
            try:
                rows.join(pending)
            except Exception:
                log.exception("The model failed on a request's prompt")
                pending.send(FAILED)
