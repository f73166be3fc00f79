"""Commands forked from a process that has already imported torch, torchmetrics and Hydra.

A train command spends most of a small run importing them (7 of 11 s on two cores), and the kill
and signal harnesses (tests/killing.py) run it hundreds of times. Each pytest process keeps one
server that imports them once, then forks a command per request: the child becomes the command
as `python -m <package> ...` (or `python -c ...`) would run it (its own session and process group,
working directory, environment, sys.path and sys.argv, standard streams on a pipe, signals as
Python starts them, Python's exit: threads joined, atexit run, the exit code of its SystemExit)
and the server reports how it ended. What differs from a new interpreter: what those libraries
read from the environment while importing, so a command whose test sets such a variable starts
anew (`usable`); what they print while importing, so the server forks nothing if they printed
anything (a new interpreter would show it); and the hash seed, which all share. Tests about a
command's own start (a signal while Python starts, a wrapper shell) use new interpreters.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Lightning itself (0.3 s once these are in) is left to the command: on import it gives its
# loggers console handlers of their own unless the root logger has some, as it has under Hydra.
PRELOADED = ("torch", "torch._dynamo", "torchmetrics", "hydra", "omegaconf")
# Read while those libraries import (thread pools, allocators, Hugging Face's cache and offline
# switches, CUDA): a command whose environment differs in one of them starts as a real process.
IMPORT_TIME_PREFIXES = (
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "NCCL", "OMP_", "MKL_",
    "KMP_", "LD_", "MALLOC", "PYTHON",
)  # fmt: skip
RUNTIME_PYTHON_VARIABLES = ("PYTHONPATH", "PYTHONFAULTHANDLER")
INHERITED_SIGNALS = (
    signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGHUP,
    signal.SIGQUIT,
)  # fmt: skip
SERVE = "import sys; from tests.warm_start import serve; serve(int(sys.argv[1]))"


class WarmProcess:
    """The part of `subprocess.Popen` that the tests use to finish a command, for a forked one:
    its output (standard output and error in one pipe, or each in its own) and exit code."""

    def __init__(self, args: list[str], pid: int, pipes: list[int], server: Server) -> None:
        self.args, self.pid = args, pid
        self.returncode: int | None = None
        self._pipes, self._server = pipes, server
        self._read = [bytearray() for _ in pipes]

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for index, pipe in enumerate(self._pipes):
                if pipe >= 0:
                    selector.register(pipe, selectors.EVENT_READ, index)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    self._read[key.data] += chunk
                    if not chunk:
                        selector.unregister(key.fd)
                        os.close(key.fd)
                        self._pipes[key.data] = -1
        self.wait(None if deadline is None else max(1.0, deadline - time.monotonic()))
        texts = [read.decode(errors="replace") for read in self._read]
        return texts[0], texts[1] if len(texts) > 1 else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.args, timeout)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


class Server:
    """One forking server for this pytest process; one command at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).parents[1])
        python_path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
        self.environment = {**os.environ, "PYTHONPATH": python_path}
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(theirs.fileno())],
            cwd=root,
            env=self.environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.socket = ours
        self.busy = threading.Lock()
        atexit.register(self.close)

    def usable(self, asked: dict[str, str]) -> bool:
        """Whether a command whose test sets these variables runs the same forked as started
        anew. (The rest of its environment is this process's, which Lightning and torch change
        as in-process tests run, at run time: PYTORCH_NVML_BASED_CUDA_CHECK, say.)"""
        return not any(
            value != self.environment.get(name)
            for name, value in asked.items()
            if name.startswith(IMPORT_TIME_PREFIXES) and name not in RUNTIME_PYTHON_VARIABLES
        )

    def start(
        self, argv: list[str], cwd: Path, environment: dict[str, str], merged: bool, session: bool
    ) -> WarmProcess:
        pipes = [os.pipe() for _ in range(1 if merged else 2)]
        writes = [write for _, write in pipes] * (2 if merged else 1)
        # Ignored signals stay ignored across exec, as in a command this process starts; a
        # session of its own answers Ctrl-C (killing.start's answer_ctrl_c).
        ignored = [
            int(number) for number in INHERITED_SIGNALS
            if signal.getsignal(number) == signal.SIG_IGN
            and not (session and number == signal.SIGINT)
        ]  # fmt: skip
        request = {
            "argv": argv, "cwd": str(cwd), "env": environment, "session": session,
            "ignored": ignored,
        }  # fmt: skip
        try:
            socket.send_fds(self.socket, [json.dumps(request).encode()], writes)
        finally:
            for _, write in pipes:
                os.close(write)
        answer = self._receive(None)
        reads = [read for read, _ in pipes]
        if "pid" not in answer:
            for read in reads:
                os.close(read)
            self.busy.release()
            raise RuntimeError(f"the warm start failed: {answer}")
        return WarmProcess([sys.executable, *argv], answer["pid"], reads, self)

    def exit_code(self, args: list[str], timeout: float | None) -> int:
        answer = self._receive(timeout, args)
        self.busy.release()
        return int(answer["exit_code"])

    def _receive(self, timeout: float | None, args: list[str] | None = None) -> dict[str, Any]:
        self.socket.settimeout(timeout)
        try:
            message = self.socket.recv(1 << 16)
        except TimeoutError:
            raise subprocess.TimeoutExpired(args or [], timeout or 0) from None
        if not message:
            raise RuntimeError(f"the warm-start server ended ({self.process.poll()})")
        return dict(json.loads(message))

    def close(self) -> None:
        self.socket.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


_server: Server | None = None


def prepare() -> None:
    """Start this process's server (it imports while the tests are collected), with the
    environment as it is now: pytest's, before any test changes it."""
    global _server
    if _server is None:
        _server = Server()


def start(
    argv: list[str], cwd: Path, environment: dict[str, str], asked: dict[str, str] | None,
    merged: bool = True, session: bool = True,
) -> WarmProcess | None:  # fmt: skip
    """`python <argv>` (`-m module ...`, `-c code ...` or `script ...`) forked from this process's
    server, its standard error `merged` into its output or apart, in a `session` and process group
    of its own or in this process's group; None where it must start anew: another option, the
    server busy with another command of this test, a variable the test `asked` for that the
    preloaded libraries read while importing."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-m", "-c")):
        return None
    if _server is None:
        prepare()
    assert _server is not None
    if not _server.usable(asked or {}) or not _server.busy.acquire(blocking=False):
        return None
    try:
        return _server.start(argv, cwd, environment, merged, session)
    except BaseException:
        if _server.busy.locked():
            _server.busy.release()
        raise


# The server side: runs in its own interpreter.


def serve(fd: int) -> None:
    printed = preload()
    channel = socket.socket(fileno=fd)
    base_path = [entry for entry in sys.path if entry and entry not in python_path(os.environ)]
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 2)
        except OSError:
            return
        if not message:
            return
        request, (output, error) = json.loads(message), fds
        if printed:  # a new interpreter would print it too: forking would hide it from the tests
            os.close(output)
            os.close(error)
            refusal = {"error": f"importing {PRELOADED} printed {printed!r}"}
            channel.send(json.dumps(refusal).encode())
            continue
        if threading.active_count() != 1:  # (numpy's BLAS pool is idle and handles a fork)
            channel.send(json.dumps({"error": "a Python thread runs: forking is unsafe"}).encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            become(request, output, error, base_path)
        os.close(output)
        os.close(error)
        channel.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        channel.send(json.dumps({"exit_code": os.waitstatus_to_exitcode(status)}).encode())


def preload() -> str:
    """Import PRELOADED; what that printed (a warning, say), which should be nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            for name in PRELOADED:
                __import__(name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        captured.seek(0)
        return captured.read().decode(errors="replace")


def python_path(environment: Any) -> list[str]:
    return [entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry]


def become(request: dict[str, Any], output: int, error: int, base_path: list[str]) -> None:
    """The forked child: the command as a new interpreter would run it; never returns."""
    if request["session"]:
        os.setsid()
    for number in INHERITED_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in request["ignored"]:
        signal.signal(number, signal.SIG_IGN)
    os.chdir(request["cwd"])
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.dup2(output, 1)
    os.dup2(error, 2)
    for fd in {nothing, output, error}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    argv = request["argv"]
    option, target, args = (
        (argv[0], argv[1], argv[2:]) if argv[0] in ("-m", "-c") else ("", argv[0], argv[1:])
    )
    first = {"-m": os.getcwd(), "-c": ""}.get(option, os.path.dirname(os.path.abspath(target)))
    sys.path[:] = [first, *python_path(os.environ), *base_path]
    import runpy

    code = 0
    try:
        if option == "-m":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif option == "-c":
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as ended:
        code = exit_code_of(ended)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def exit_code_of(ended: SystemExit) -> int:
    if ended.code is None:
        return 0
    if isinstance(ended.code, int):
        return ended.code
    print(ended.code, file=sys.stderr)
    return 1
