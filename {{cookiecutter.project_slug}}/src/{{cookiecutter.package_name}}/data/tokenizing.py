"""The prepare command's side of its tokenizing worker processes (`tokenizing_worker` is theirs):
it starts them, hands them batches of pieces as they become free and gives back their token ids
in order, and ends every one of them, and waits for it, however the command ends."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import tokenizing_worker
from .errors import ConfigError
from .tokenizing_worker import ANSWER, ERROR, LENGTH, REFUSED, pack_pieces, read_exactly

FIRST_TOKENS = "First tokens back %.2f s after the command started"
SECONDS_TO_END = 10.0  # for a worker to end once its stdin is closed, before it is killed


class TokenizerWorkerError(RuntimeError):
    """A worker failed or ended before it answered."""


def ended(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def importing_this_package() -> dict[str, str]:
    """This process's environment, with the folder this package was imported from first on
    PYTHONPATH: a process started with it imports the same package."""
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}


class TokenizerWorkers:
    """`count` worker processes, started at once (the tokenizer comes later, with `load`), all
    ended and waited for when the `with` block ends, however it ends."""

    def __init__(self, count: int) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        # One process per core already: the library's own threads would only compete.
        environment = {**importing_this_package(), "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, "-m", tokenizing_worker.__name__, str(os.getpid())]
        try:
            for _ in range(count):
                self.processes.append(
                    subprocess.Popen(
                        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment
                    )
                )
        except BaseException:
            self.close(kill=True)
            raise
        self.threads: list[threading.Thread] = []
        self.dtype: np.dtype[Any] = np.dtype("<u2")

    def __enter__(self) -> TokenizerWorkers:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        self.close(kill=kind is not None)

    def load(self, tokenizer: Path, dtype: np.dtype[Any]) -> None:
        """Every worker loads the tokenizer saved at `tokenizer` (they start before it exists)."""
        self.dtype = dtype
        header = json.dumps({"tokenizer": str(tokenizer), "dtype": dtype.str}).encode()
        for process in self.processes:
            assert process.stdin is not None
            try:
                process.stdin.write(LENGTH.pack(len(header)) + header)
                process.stdin.flush()
            except OSError:
                pass  # it has ended: its first answer says how

    def tokenize(self, batches: Sequence[Sequence[str]]) -> Iterator[np.ndarray[Any, Any]]:
        """The token ids of each batch, in order. A thread for each worker takes the next batch
        not yet taken, sends it and waits for its answer, so that a worker that is done early
        takes more and all finish together."""
        answers: dict[int, np.ndarray[Any, Any] | BaseException] = {}
        arrived = threading.Condition()
        untaken = iter(range(len(batches)))

        def serve_one(process: subprocess.Popen[bytes]) -> None:
            while True:
                with arrived:
                    index = next(untaken, None)
                if index is None:  # nothing left for it: it ends while the others finish
                    assert process.stdin is not None
                    with contextlib.suppress(OSError):
                        process.stdin.close()
                    return
                answer: np.ndarray[Any, Any] | BaseException
                try:
                    self.send(process, batches[index])
                    answer = self.answer(process)
                except Exception as error:  # the consumer raises it, in order
                    answer = error
                with arrived:
                    answers[index] = answer
                    arrived.notify_all()
                if isinstance(answer, BaseException):
                    return

        self.threads = [
            threading.Thread(target=serve_one, args=(process,), daemon=True)
            for process in self.processes
        ]
        for thread in self.threads:
            thread.start()
        for index in range(len(batches)):
            with arrived:
                while index not in answers:
                    arrived.wait()  # a signal's handler still runs, and may raise, meanwhile
                answer = answers.pop(index)
            if isinstance(answer, BaseException):
                raise answer
            yield answer

    def send(self, process: subprocess.Popen[bytes], batch: Sequence[str]) -> None:
        assert process.stdin is not None
        try:
            process.stdin.write(pack_pieces(batch))
            process.stdin.flush()
        except (OSError, ValueError):  # it ended, or was ended: its answer says how
            pass

    def answer(self, process: subprocess.Popen[bytes]) -> np.ndarray[Any, Any]:
        assert process.stdout is not None
        header, data = read_exactly(process.stdout, ANSWER.size), None
        if header is not None:
            kind, size = ANSWER.unpack(header)
            data = read_exactly(process.stdout, size)
        if header is None or data is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(SECONDS_TO_END)
            raise TokenizerWorkerError(
                f"a tokenizing worker process (pid {process.pid}) ended before it answered "
                f"({ended(process.poll())}): if the system ran out of memory, use fewer workers=..."
            )
        if kind == REFUSED:
            raise ConfigError(data.decode(errors="replace"))
        if kind == ERROR:
            raise TokenizerWorkerError(
                f"a tokenizing worker process failed ({data.decode(errors='replace')}; its "
                "traceback is above)."
            )
        return np.frombuffer(data, dtype=self.dtype)

    def close(self, kill: bool = False) -> None:
        """Ends every worker: on success by closing its stdin (it finishes and exits), else by
        SIGKILL; then waits for each, so that none outlives the command."""
        for process in self.processes:
            if kill:
                process.kill()
            elif process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
        for process in self.processes:
            try:
                process.wait(SECONDS_TO_END)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for thread in self.threads:
            thread.join()
        for process in self.processes:
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


def seconds_since_start() -> float | None:
    """How long ago this process started (Linux), else None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def first_tokens_seconds(log: str) -> float | None:
    """The first-batch latency that a prepare command's log reports, if it does."""
    found = re.search(FIRST_TOKENS.replace("%.2f", r"([0-9.]+)"), log)
    return float(found.group(1)) if found else None
