"""A torchrun agent that dies alone (SIGKILL to the agent of one node, not to its worker): its
worker stops too, saving where it stands, the other node sees it go, both exit non-zero at once
instead of one training on unwatched and the other waiting in torchrun's exit barrier, and the
same two commands resume the run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers import PACKAGE, run_cli
from .killing import SMALL_RUN, assert_same_outcome
from .test_scale_out import free_port, kill_tree, start_node, two_nodes

# One second a step; the ranks agree on a stop signal at every step (10 by default, which a run
# of 12 steps with early stopping at 8 would never reach).
SLOW_STEPS = [
    "+callbacks.slow._target_=tests.faults.SlowSteps", "+callbacks.slow.seconds=1",
    "callbacks.preemption.sync_every_n_steps=1",
]  # fmt: skip
# The next step after which no validation is due, a checkpoint, and the process's exit.
STEPS_AFTER_THE_SIGNAL = 2
WORKER_STOPS_WITHIN_S = 15
ARGS = [*SMALL_RUN, *SLOW_STEPS]
NODES_EXIT_WITHIN_S = 60


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie that no one has reaped yet."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def steps_recorded(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run that no one stopped."""
    cwd = tmp_path_factory.mktemp("reference")
    assert two_nodes(cwd, ARGS) == [0, 0]
    return cwd


@pytest.mark.slow
@pytest.mark.parametrize("node_rank", [1, 0], ids=["node1", "node0_hosting_the_store"])
def test_killing_one_torchrun_agent_alone_stops_its_worker_both_nodes_and_resumes(
    tmp_path: Path, reference: Path, node_rank: int
) -> None:
    port = free_port()
    nodes = [start_node(rank, port, tmp_path, ARGS) for rank in (0, 1)]
    batches = tmp_path / f"batches.txt.rank{node_rank}"
    agent, worker = nodes[node_rank], None
    try:
        assert wait_for(lambda: steps_recorded(batches) > 2, 120), "training never started"
        (worker,) = children_of(agent.pid)
        os.kill(agent.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        steps_at_kill = steps_recorded(batches)
        stopped = wait_for(lambda: not running(worker), WORKER_STOPS_WITHIN_S)
        log = (tmp_path / f"node{node_rank}.log").read_text()[-3000:]
        trained_on = steps_recorded(batches) - steps_at_kill
        assert trained_on <= STEPS_AFTER_THE_SIGNAL, (
            f"the worker trained {trained_on} steps on without its agent\n{log}"
        )
        assert stopped, f"the worker still runs {WORKER_STOPS_WITHIN_S} s later\n{log}"
        assert "Received SIGTERM: saving" in log, log
        codes = []
        for node in nodes:
            left = NODES_EXIT_WITHIN_S - (time.monotonic() - killed_at)
            codes.append(node.wait(timeout=max(left, 0.1)))
    finally:
        for pid in [node.pid for node in nodes] + ([worker] if worker else []):
            kill_tree(pid)  # the worker too: an orphan is out of its agent's reach
        for node in nodes:
            node.wait()
    assert codes[node_rank] == -signal.SIGKILL
    assert codes[1 - node_rank] not in (0, None), "the other node saw its peer fail"

    assert two_nodes(tmp_path, ARGS) == [0, 0], "the same two commands resume the run"
    assert_same_outcome(reference, tmp_path)


UNDER_TORCHRUN = {"TORCHELASTIC_RUN_ID": "test"}


def test_a_worker_gets_sigterm_when_its_agent_dies() -> None:
    """An agent (a shell here) starts a worker and is killed; the kernel sends the worker
    SIGTERM, whose default action ends it before its run starts."""
    worker = (
        f"from {PACKAGE}.run.parent_death import stop_when_the_torchrun_agent_dies as stop; "
        "stop(); print('ready', flush=True); import time; time.sleep(60)"
    )
    agent = subprocess.Popen(
        ["bash", "-c", f'TORCHRUN_AGENT_PID=$$ "{sys.executable}" -c "{worker}" & echo $!; wait'],
        env={**os.environ, **UNDER_TORCHRUN}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert agent.stdout is not None
    worker_pid = int(agent.stdout.readline())
    try:
        assert agent.stdout.readline().strip() == "ready"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        assert wait_for(lambda: not running(worker_pid), 10), "the worker outlived its agent"
    finally:
        kill_tree(worker_pid)
        agent.stdout.close()


def test_a_worker_whose_agent_died_before_it_started_stops_at_once(tmp_path: Path) -> None:
    """The agent died between starting the worker and the worker asking to be told: the train
    command ends as SIGTERM ends it, before anything is written."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead_agent = str(finished.pid)
    result = run_cli(
        "-m", PACKAGE, "trainer=cpu", "logger=csv", "trainer.max_steps=1",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", cwd=tmp_path,
        env={**UNDER_TORCHRUN, "TORCHRUN_AGENT_PID": dead_agent},
    )  # fmt: skip
    assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
    assert not list(tmp_path.iterdir()), "nothing written"
    under_its_agent = run_cli(
        "-c", f"import os; os.environ['TORCHRUN_AGENT_PID'] = str(os.getppid()); "
        f"from {PACKAGE}.run.parent_death import stop_when_the_torchrun_agent_dies as stop; "
        "stop(); print('on')", cwd=tmp_path, env=UNDER_TORCHRUN,
    )  # fmt: skip
    assert (under_its_agent.returncode, under_its_agent.stdout) == (0, "on\n")
