"""The signals that ask a run to stop (SIGTERM from `timeout`, SLURM or Kubernetes; SIGUSR1/SIGUSR2,
SLURM's and submitit's warning before a time limit). A handler only records the first one; the
run decides where it is safe to stop (`callbacks.Preemption`) and the recipe turns the stop into
exit code 143. Until the run's loop starts, SIGTERM keeps its default action, which ends the
process at once, even while it waits inside torch (for a peer that never comes, for data):
nothing is written before then, and the same command resumes. No torch here.

Ctrl-C (SIGINT) is a stop signal too, once the loop runs: the run saves as on SIGTERM, says so in
one line and exits 130. Before the loop (and in a sweep's driver between jobs) it ends the command
with that line at once (`Interrupted`, which the console script prints): nothing is there to save.
A second Ctrl-C always ends the process at once, by SIGINT's default action."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from ..data.daemon_children import kill_daemon_children

STOPPED_BY_SIGNAL_EXIT_CODE = 143
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")

_watched: tuple[signal.Signals, ...] = ()
_sigterm_recorded = False
_received: signal.Signals | None = None
_before_the_run: signal.Signals | None = None
_received_at: float | None = None  # Unix time


class Interrupted(BaseException):
    """Ctrl-C before a run's loop started (not a KeyboardInterrupt, which Lightning turns into
    exit code 1): the console script prints it as one line and exits 130."""

    def __init__(self, where: str = "before training started") -> None:
        super().__init__(
            f"Stopped by Ctrl-C {where}: nothing new to save; run the same command to resume."
        )
        self.run_dir = hydra_job_folder()


def hydra_job_folder() -> str | None:
    """The folder of the Hydra job under way, if any (Hydra forgets it as the job ends)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return str(HydraConfig.get().runtime.output_dir)
    except Exception:  # no job, or not yet its folder
        return None


def _second_interrupt_ends_at_once() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(number: int, frame: FrameType | None) -> None:
    global _before_the_run, _received, _received_at
    _second_interrupt_ends_at_once()
    # Kept as well, should the exception be swallowed (raised inside a finalizer, say): the run
    # then stops at its first safe point instead.
    if _watched:
        _received, _received_at = _received or signal.SIGINT, time.time()
    elif _before_the_run is None:
        _before_the_run, _received_at = signal.SIGINT, time.time()
    raise Interrupted()


def interrupt_from_startup() -> None:
    """Ctrl-C from a command's first moments ends it with one line (`Interrupted`) instead of a
    KeyboardInterrupt's traceback; a run's loop records it instead (`watch`)."""
    current = signal.getsignal(signal.SIGINT)
    if current is signal.default_int_handler or getattr(current, "starting_up", False):
        signal.signal(signal.SIGINT, _interrupt)


_when_warned: Callable[[], None] | None = None


def when_warned(answer: Callable[[], None] | None) -> None:
    """`answer` is called once a stop signal has been recorded during the run (in the signal's
    handler: it may raise), until `watch` ends."""
    global _when_warned
    _when_warned = answer


def _record(number: int, frame: FrameType | None) -> None:
    global _received, _received_at
    if number == signal.SIGINT:
        _second_interrupt_ends_at_once()
    if _received is None:
        _received, _received_at = signal.Signals(number), time.time()
        if _when_warned is not None:
            _when_warned()


def _record_before_the_run(number: int, frame: FrameType | None) -> None:
    global _before_the_run, _received_at
    if _before_the_run is None:
        _before_the_run, _received_at = signal.Signals(number), time.time()


WARNINGS = ("SIGUSR1", "SIGUSR2")


def record_from_startup(names: Iterable[str] = WARNINGS) -> None:
    """Record SLURM's warnings from a run's first moments (taking over what the console script's
    first instruction recorded, `entry`): their default action ends a process at once, so a
    warning that came while Python still imported ended the job unsaved and never requeued. The run, once it `watch`es, stops at its first safe point and requeues. (SIGTERM
    keeps its default until then: nothing is written yet, and the same command resumes.)"""
    global _before_the_run, _received_at
    for name in names:
        number = signal.Signals[name]
        current = signal.getsignal(number)
        if current in (signal.SIG_DFL, None) or hasattr(current, "first"):
            signal.signal(number, _record_before_the_run)
            # entry.EarlyRecorder: a warning that came while the command started
            early = getattr(current, "first", None)
            if early is not None:
                _before_the_run, _received_at = early


def received() -> signal.Signals | None:
    """The first stop signal since `watch` began, if any."""
    return _received


def received_at() -> float | None:
    """When the first stop signal came (Unix time), if one has."""
    return _received_at if _received is not None else None


def reassert() -> None:
    """Take the watched signals back from a handler installed since (Lightning installs its own
    at the start of every `fit` and `test`, which ends the run with exit code 0); SIGTERM too,
    from here on recorded."""
    global _sigterm_recorded
    for number in _watched:
        if not (number == signal.SIGINT and _received == signal.SIGINT):  # a second one: at once
            signal.signal(number, _record)
    _sigterm_recorded = signal.SIGTERM in _watched


def rearm() -> None:
    """After Lightning's `fit` put back the handlers it found (SIGTERM's default, then), record
    the signals again if the loop had started."""
    if _sigterm_recorded:
        reassert()


def record_warnings() -> None:
    """The watched signals but SIGTERM and SIGINT recorded; SIGTERM ends the process as by
    default, SIGINT with one line (`Interrupted`)."""
    before_the_loop: dict[signal.Signals, Any] = {
        signal.SIGTERM: signal.SIG_DFL,
        signal.SIGINT: _interrupt,
    }
    for number in _watched:
        signal.signal(number, before_the_loop.get(number, _record))


def answers_ctrl_c() -> bool:
    """SIGINT has Python's handler or ours: not ignored (a job started in the background), nor
    taken by another handler."""
    return signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _interrupt, _record)


def ignore_warnings(names: Iterable[str] = WARNINGS) -> None:
    """Once the command's work is over: a warning then has nothing left to save, and Python's
    exit restores the default handlers, whose action would end the finished job as failed."""
    for name in names:
        signal.signal(signal.Signals[name], signal.SIG_IGN)


@contextmanager
def watch(names: Iterable[str] = STOP_SIGNALS) -> Iterator[None]:
    """Record stop signals for the duration of a run, then put the previous handlers back."""
    global _watched, _received, _before_the_run, _received_at, _sigterm_recorded
    numbers = tuple(signal.Signals[name] for name in names if name != "SIGINT" or answers_ctrl_c())
    previous: dict[signal.Signals, Any] = {n: signal.getsignal(n) for n in numbers}
    _watched, _received, _before_the_run = numbers, _before_the_run, None
    if _received is None:
        _received_at = None
    record_warnings()
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _watched, _sigterm_recorded = (), False
        when_warned(None)
        kill_daemon_children()
