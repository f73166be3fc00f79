"""The console scripts that run a model (train, eval, predict) start here. Their first
instruction records SLURM's time-limit warnings (SIGUSR1, SIGUSR2) and answers Ctrl-C with one
line (train, eval), before the imports (Hydra, torch) that take the next second: a warning's default action
would end the job unsaved and never requeued. The run takes the recorded warning over once it
can save (`run.stop_signals`) and stops at its first safe point. Only `signal` is imported here.
SIGTERM keeps its default until the run's loop starts: nothing is written before then."""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType

WARNINGS = (signal.SIGUSR1, signal.SIGUSR2)
INTERRUPTED_EXIT_CODE = 130


class EarlyRecorder:
    """A handler that keeps the first warning and when it came (`first`), for the run."""

    def __init__(self) -> None:
        self.first: tuple[signal.Signals, float] | None = None

    def __call__(self, number: int, frame: FrameType | None) -> None:
        if self.first is None:
            self.first = (signal.Signals(number), time.time())

    def take_noted(self, path: str) -> None:
        """The first warning that the task's shell noted in `path` before this process could
        record it, if any."""
        try:
            with open(path, "rb") as noted:
                name = noted.read(16).split(b"\n")[0].decode("ascii", "replace")
                when = os.fstat(noted.fileno()).st_mtime
        except OSError:
            return
        if self.first is None and name in ("SIGUSR1", "SIGUSR2"):
            self.first = (signal.Signals[name], when)


def interrupted(number: int, frame: FrameType | None) -> None:
    print(
        "Stopped by Ctrl-C before training started: nothing new to save; run the same command "
        "to resume.",
        file=sys.stderr,
    )
    raise SystemExit(INTERRUPTED_EXIT_CODE)


interrupted.starting_up = True  # type: ignore[attr-defined]  # run.stop_signals replaces it


def catch_from_the_start(warnings: bool = True, ctrl_c: bool = True) -> None:
    recorder = EarlyRecorder()
    # scripts/slurm.sbatch starts the command with the warnings ignored and writes those that
    # come meanwhile to this file.
    noted = os.environ.get("STOP_SIGNALS_FILE") if warnings else None
    for number in WARNINGS if warnings else ():
        current = signal.getsignal(number)
        if current in (signal.SIG_DFL, None) or (noted and current == signal.SIG_IGN):
            signal.signal(number, recorder)
    if noted:
        recorder.take_noted(noted)
    if ctrl_c and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted)


def train() -> None:
    # A sweep's driver stops as it always did: its jobs record their own warnings.
    catch_from_the_start(warnings=not {"-m", "--multirun"} & set(sys.argv[1:]))
    from .cli import train as command

    command()


def evaluate() -> None:
    catch_from_the_start()
    from .cli import evaluate as command

    command()


def predict() -> None:
    catch_from_the_start(ctrl_c=False)
    from .cli import predict as command

    command()
