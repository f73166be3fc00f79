"""The kill, signal and command-line tests fork their commands from a process that has imported
torch and Hydra (tests/warm_start.py): a forked command sees what a new interpreter would."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from .helpers import PACKAGE, run_cli

PROBE = f"""
import json, logging, os, signal, sys
logging.basicConfig()  # as Hydra's job logging, before the command imports Lightning
import lightning
from {PACKAGE} import cli
handlers = [str(signal.getsignal(number)) for number in (2, 10, 12, 15)]
print(json.dumps(dict(
    argv=sys.argv, cwd=os.getcwd(), path0=sys.path[0], variable=os.environ.get("PROBE"),
    stdin=sys.stdin.read(), own_group=os.getpgrp() == os.getpid(), handlers=handlers,
    lightning_propagates=logging.getLogger("lightning.pytorch").propagate,
    main=sys.modules["__main__"].__name__, project=cli.__name__,
)))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_command_sees_what_a_new_interpreter_would(tmp_path: Path) -> None:
    forked = run_cli("-c", PROBE, "3", cwd=tmp_path, env={"PROBE": "x"})
    fresh = run_cli("-c", PROBE, "3", cwd=tmp_path, env={"PROBE": "x"}, fresh=True)
    assert (
        (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr) == (3, "to stderr\n")
    )
    assert json.loads(forked.stdout) == json.loads(fresh.stdout)


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [("raise ValueError('no')", 1), ("import os; os.kill(os.getpid(), 9)", -9),
     ("raise KeyboardInterrupt", -signal.SIGINT), ("raise SystemExit('said')", 1)],
)  # fmt: skip
def test_a_forked_command_ends_as_a_new_interpreter_would(
    code: str, exit_code: int, tmp_path: Path
) -> None:
    forked = run_cli("-c", code, cwd=tmp_path)
    assert forked.returncode == exit_code, forked.stderr
    fresh = run_cli("-c", code, cwd=tmp_path, fresh=True)
    assert fresh.returncode == exit_code
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
