"""SIGTERM, SIGUSR1, SIGUSR2 and Ctrl-C (SIGINT) in each phase, sent to the main process or to its
whole process group (DataLoader workers and all), alone and inside a multirun: the run never exits
0 before it is finished, saves what it trained, exits 143 (130 for Ctrl-C), and the same command
finishes it exactly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .helpers import PACKAGE, PROJECT_ROOT
from .killing import (
    SMALL_RUN,
    References,
    answer_ctrl_c,
    assert_same_outcome,
    batches_by_step,
    fault,
    finish,
    run,
    run_dir,
    start,
)

WORKERS = ["data.num_workers=1"]

# phase, occurrence, signal, to the whole group, what the run says, the step it saved (if any)
STOP_CASES = {
    "sanity check": ("sanity_check", 1, "SIGTERM", False, "during the sanity check: nothing new", None),
    "training step, group, DataLoader worker": ("train_step", 2, "SIGTERM", True, "at step 2: saved", 2),
    "a checkpoint write, group": ("checkpoint_write", 1, "SIGTERM", True, "at step 5: saved", 5),
    "validation: it finishes, saves a step later": ("validation", 1, "SIGTERM", False, "at step 5: saved", 5),
    "validation, SIGUSR1 to the group": ("validation", 1, "SIGUSR1", True, "at step 5: saved", 5),
    "early stopping decided": ("early_stop", 1, "SIGTERM", False, "after training: saved", 8),
    "end of fit": ("fit_end", 1, "SIGTERM", False, "after training: saved", 8),
    "test, group, DataLoader worker": ("test", 1, "SIGTERM", True, "during the test: nothing new", 8),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STOP_CASES))
def test_signal_in_a_phase_exits_143_and_the_same_command_finishes_exactly(
    tmp_path: Path, case: str, reference_run: References
) -> None:
    phase, at, signal_name, whole_group, says, saved_step = STOP_CASES[case]
    stop = fault(phase, at, tmp_path / "fired", signal_name, whole_group)
    command = [*SMALL_RUN, *WORKERS, *stop]
    code, output = run(command, tmp_path / "run")
    assert code == 143, output[-3000:]
    assert f"{signal_name} {says}" in output
    folder = run_dir(tmp_path / "run")
    assert not (folder / "metrics.json").exists(), "a stopped run is not a finished one"
    last = folder / "checkpoints" / "last.ckpt"
    if saved_step is None:
        assert not last.exists()
    else:
        assert torch.load(last, weights_only=True)["global_step"] == saved_step

    code, output = run(command, tmp_path / "run")
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run(SMALL_RUN), tmp_path / "run")


@pytest.mark.slow
def test_ctrl_c_saves_at_the_step_says_so_in_one_line_exits_130_and_the_same_command_finishes(
    tmp_path: Path, reference_run: References
) -> None:
    """Ctrl-C (SIGINT to the whole foreground group, DataLoader workers included) finishes the
    step, saves last.ckpt as SIGTERM does and exits 130, without a traceback."""
    command = [*SMALL_RUN, *WORKERS, *fault("train_step", 2, tmp_path / "fired", "SIGINT", True)]
    code, output = run(command, tmp_path / "run")
    assert code == 130, output[-3000:]
    last = run_dir(tmp_path / "run") / "checkpoints" / "last.ckpt"
    said = f"Stopped by Ctrl-C at step 2: saved {last}; run the same command to resume."
    assert said in output, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert torch.load(last, weights_only=True)["global_step"] == 2

    code, output = run(command, tmp_path / "run")
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run(SMALL_RUN), tmp_path / "run")


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_saves_the_job_stops_the_sweep_and_the_same_command_finishes_it(
    tmp_path: Path,
) -> None:
    """Ctrl-C during the first job of a multirun: that job saves, no other job starts, the sweep
    exits 130; the same command resumes the job and runs the other."""
    interrupt = fault("train_step", 2, tmp_path / "fired", "SIGINT", whole_group=True)
    sweep = ["--multirun", *SMALL_RUN, *WORKERS, *interrupt, "trainer.max_epochs=1", "seed=1,2"]
    code, output = run(sweep, tmp_path)
    assert code == 130, output[-3000:]
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    saved = sweep_dir / "0" / "checkpoints" / "last.ckpt"
    assert f"Stopped by Ctrl-C at step 2: saved {saved}" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not (sweep_dir / "1").exists(), "no job starts after Ctrl-C"

    code, output = run(sweep, tmp_path)
    assert code == 0, output[-3000:]
    assert "Resuming from" in output
    rows = (sweep_dir / "summary.csv").read_text().split()[1:]
    assert [row.split(",")[2] for row in rows] == ["COMPLETED", "COMPLETED"]


def test_ctrl_c_before_training_ends_the_command_in_one_line_and_leaves_no_run_folder(
    tmp_path: Path,
) -> None:
    """Before the loop there is nothing to save: Ctrl-C, once the run has its folder, ends the
    command at once with one line and exit code 130, and the folder goes."""
    running = start([*SMALL_RUN, "trainer.max_epochs=1"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("logs/train/runs/*/train.log")):
            assert running.poll() is None and time.monotonic() < deadline, "it never started"
            time.sleep(0.05)
        os.killpg(running.pid, signal.SIGINT)
        code, output = finish(running, timeout=120)
    finally:
        if running.poll() is None:
            os.killpg(running.pid, signal.SIGKILL)
            running.wait()
    assert code == 130, output[-3000:]
    said = "Stopped by Ctrl-C before training started: nothing new to save; run the same command"
    assert said in output and "Traceback" not in output, output[-3000:]
    assert not list(tmp_path.glob("logs/train/runs/*")), "a run that never started leaves nothing"


SECOND_CTRL_C = """
import os, signal, sys
from {package}.run import stop_signals

with stop_signals.watch():
    stop_signals.reassert()  # as the run's loop starts
    os.kill(os.getpid(), signal.SIGINT)
    assert stop_signals.received() == signal.SIGINT, "the first Ctrl-C is recorded"
    print("recorded; the run goes on to its next step", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    print("the second Ctrl-C did not stop it", flush=True)
"""


def test_a_second_ctrl_c_ends_the_run_at_once(tmp_path: Path) -> None:
    """The first Ctrl-C is recorded (the run saves at its next step); a second one, for when that
    takes too long, ends the process at once by SIGINT's default action: no traceback."""
    result = subprocess.run(
        [sys.executable, "-c", SECOND_CTRL_C.format(package=PACKAGE)], cwd=tmp_path,
        capture_output=True, text=True, timeout=60, preexec_fn=answer_ctrl_c,
    )  # fmt: skip
    assert result.returncode == -signal.SIGINT, result.stdout + result.stderr
    assert result.stdout == "recorded; the run goes on to its next step\n"
    assert result.stderr == ""


ACCUMULATING = [*SMALL_RUN, "trainer.accumulate_grad_batches=2"]


@pytest.mark.slow
def test_a_signal_inside_a_gradient_accumulation_window_saves_where_the_window_ends(
    tmp_path: Path, reference_run: References
) -> None:
    """SIGTERM after batch 3, the first half of step 2's window: batch 4 ends step 2, which a
    validation follows, batch 5 opens step 3's window, and batch 6 ends it: the save is there.
    Saving at batch 3 lost its gradient, and the resumed run's weights differed."""
    command = [*ACCUMULATING, *fault("train_batch", 3, tmp_path / "fired", "SIGTERM")]
    code, output = run(command, tmp_path / "run")
    assert code == 143, output[-3000:]
    last = run_dir(tmp_path / "run") / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    code, output = run(command, tmp_path / "run")
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run(ACCUMULATING), tmp_path / "run")


@pytest.mark.slow
def test_signal_after_the_test_lets_the_finished_run_end_with_0(
    tmp_path: Path, reference_run: References
) -> None:
    """Once the test has run, the run is complete: it writes metrics.json and exits 0."""
    command = [*SMALL_RUN, *fault("test_end", 1, tmp_path / "fired", "SIGTERM", True)]
    code, output = run(command, tmp_path / "run")
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run(SMALL_RUN), tmp_path / "run")


@pytest.mark.slow
def test_sigterm_to_one_ddp_rank_stops_both_at_the_next_agreement_step(
    tmp_path: Path, reference_run: References
) -> None:
    """Under DDP the ranks agree on a signal every `sync_every_n_steps` steps, not every step:
    SIGTERM to rank 0 after step 1 makes both ranks save at step 3 and exit 143."""
    ddp = ["strategy=ddp", "trainer.devices=2", "callbacks.preemption.sync_every_n_steps=3"]
    command = [*SMALL_RUN, *ddp, *fault("train_step", 1, tmp_path / "fired", "SIGTERM")]
    code, output = run(command, tmp_path / "run")
    assert code == 143, output[-3000:]
    assert "Received SIGTERM: saving" in output, "rank 0 got the signal"
    assert "Received a signal on another rank: saving" in output, "rank 1 learned of it"
    last = run_dir(tmp_path / "run") / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    trained = batches_by_step(tmp_path / "run")
    assert [sorted(trained[rank]) for rank in (".rank0", ".rank1")] == [list(range(3))] * 2

    code, output = run(command, tmp_path / "run")
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run([*SMALL_RUN, *ddp]), tmp_path / "run")


@pytest.mark.slow
def test_sigusr1_under_slurm_saves_and_requeues_the_job(tmp_path: Path) -> None:
    """SLURM's time-limit warning (`sbatch --signal=USR1@90`): save at a step boundary, then
    `scontrol requeue <job id>`, which makes SLURM send SIGTERM to the job's processes: here a
    fake scontrol records its arguments and then signals the run every 50 ms for 3 s, so one
    lands in whatever the run does after it requeued. The run still says how it stopped and
    exits 143 (it used to die by the signal before its last line, now and then, on a cluster)."""
    env = fake_scontrol(tmp_path, terminates=True)
    command = [*SMALL_RUN, *fault("train_step", 3, tmp_path / "fired", "SIGUSR1")]
    code, output = run(command, tmp_path / "job", env)
    assert code == 143, output[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    (stopped,) = re.findall(r"Stopped: (.*)", output)
    assert "SIGUSR1 at step 3: saved" in stopped and stopped.endswith("requeued the job."), output


def fake_scontrol(tmp_path: Path, terminates: bool = False) -> dict[str, str]:
    """A SLURM job's environment whose scontrol records its arguments in scontrol.log and, where
    it `terminates`, then sends SIGTERM to its caller every 50 ms for 3 s, as SLURM ends a
    requeued job's processes (SIGTERM, then SIGKILL after KillWait)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    signals = "(for i in $(seq 60); do kill -TERM $PPID || exit 0; sleep 0.05; done) </dev/null >/dev/null 2>&1 &\n"
    scontrol.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n{signals if terminates else ""}'
    )
    scontrol.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.15, 0.3, 1.0])
def test_a_warning_while_the_command_starts_is_kept_and_the_job_requeued(
    delay: float, tmp_path: Path
) -> None:
    """SIGUSR1 while Python still imports (Hydra, torch): the console script's first instruction
    records it (`entry`), so it is answered once the run can save instead of by the signal's
    default action, which ended the job unsaved and never requeued (rc 138)."""
    env = fake_scontrol(tmp_path)
    running = start([*SMALL_RUN, "trainer.max_epochs=1"], tmp_path / "job", env)
    code, output = warned_after(running, delay, running.send_signal)
    assert code == 143, f"exit {code}: {output[-3000:]}"
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert "requeued the job" in output and "Traceback" not in output, output[-3000:]


def task_shell() -> str:
    """The shell that scripts/slurm.sbatch starts each task under (its TASK heredoc)."""
    script = (PROJECT_ROOT / "scripts" / "slurm.sbatch").read_text()
    return script.split("<<'TASK' || true\n", 1)[1].split("\nTASK\n", 1)[0]


def warned_after(
    running: subprocess.Popen[str], delay: float, send: Callable[[int], object]
) -> tuple[int, str]:
    """SIGUSR1 `delay` s after the start (`send`: to the process, or to its group), then the
    command's exit code and output."""
    try:
        time.sleep(delay)
        send(signal.SIGUSR1)
        return finish(running, timeout=300)
    finally:
        if running.poll() is None:
            os.killpg(running.pid, signal.SIGKILL)
            running.wait()


@pytest.mark.slow
def test_a_warning_while_python_itself_starts_is_held_by_the_sbatch_task_shell(
    tmp_path: Path,
) -> None:
    """SIGUSR1 to the task's whole process group (as SLURM signals a step) 20 ms after it
    starts, while Python is still starting, before the command's first instruction can record
    anything: started as scripts/slurm.sbatch starts a task, the warning is held, then answered
    as any other (requeued; without that shell the command dies of it, exit -10)."""
    env = fake_scontrol(tmp_path)
    under = ("bash", "-c", task_shell(), "task")
    task = start([*SMALL_RUN, "trainer.max_epochs=1"], tmp_path / "job", env, under=under)
    code, output = warned_after(task, 0.02, lambda number: os.killpg(task.pid, number))
    assert code == 143, f"exit {code}: {output[-3000:]}"
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    (stopped,) = re.findall(r"Stopped: (SIGUSR1 .*)", output)
    assert stopped.endswith("requeued the job."), stopped


@pytest.mark.slow
def test_sigterm_to_a_multirun_group_stops_the_sweep_and_the_same_command_finishes_it(
    tmp_path: Path,
) -> None:
    """SIGTERM to the whole process group (what `timeout`, SLURM and Kubernetes send) during the
    first job, DataLoader workers included: that job saves and the sweep stops with 143, starting
    no other job; the same command then finishes both."""
    term = fault("train_step", 2, tmp_path / "fired", "SIGTERM", whole_group=True)
    sweep = ["--multirun", *SMALL_RUN, *WORKERS, *term, "trainer.max_epochs=1", "seed=1,2"]
    code, output = run(sweep, tmp_path)
    assert code == 143, output[-3000:]
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert f"SIGTERM at step 2: saved {sweep_dir / '0' / 'checkpoints' / 'last.ckpt'}" in output
    assert not (sweep_dir / "1").exists(), "no job starts after the signal"

    code, output = run(sweep, tmp_path)
    assert code == 0, output[-3000:]
    assert "Resuming from" in output
    rows = (sweep_dir / "summary.csv").read_text().split()[1:]
    assert [row.split(",")[2] for row in rows] == ["COMPLETED", "COMPLETED"]


@pytest.mark.slow
def test_sigterm_during_eval_exits_143(tmp_path: Path) -> None:
    code, output = run([*SMALL_RUN, "callbacks.early_stopping=null"], tmp_path / "train")
    assert code == 0, output[-3000:]
    last = run_dir(tmp_path / "train") / "checkpoints" / "last.ckpt"
    evaluate = [
        "trainer=cpu", "logger=none", f"ckpt_path='{last}'",
        "allowed_targets=[tests.faults.FaultAt]", "+callbacks.fault._target_=tests.faults.FaultAt",
        "+callbacks.fault.phase=test", f"+callbacks.fault.marker={tmp_path / 'fired'}",
        "+callbacks.fault.signal_name=SIGTERM",
    ]  # fmt: skip
    code, output = run(evaluate, tmp_path / "eval", entry="evaluate")
    assert code == 143, output[-3000:]


def test_sigterm_ends_a_run_still_waiting_for_its_peers(tmp_path: Path) -> None:
    """Rank 0 of two, under torchrun's environment, waits for a rank that never comes: nothing is
    written yet, so SIGTERM (`timeout`, a scheduler) ends it at once instead of being recorded
    for a training step that never comes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "alone",
    }  # fmt: skip
    command = [*SMALL_RUN, "strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2"]
    waiting = start(command, tmp_path, env)
    try:
        deadline = time.monotonic() + 120
        while not any(
            "Initializing distributed" in log.read_text()
            for log in tmp_path.glob("logs/train/runs/*/train.log")
        ):
            assert waiting.poll() is None and time.monotonic() < deadline, "it never started"
            time.sleep(0.2)
        time.sleep(1)
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=30) in (-signal.SIGTERM, 143)
    finally:
        if waiting.poll() is None:
            os.killpg(waiting.pid, signal.SIGKILL)
        waiting.wait()
        assert waiting.stdout is not None
        waiting.stdout.close()


NUMBERS = """
import os, signal
import torch
import torch.distributed as dist
from {package}.data.base import FORK_MAY_HANG, SplitDataModule

class Numbers(SplitDataModule):
    def load_splits(self):
        numbers = torch.utils.data.TensorDataset(torch.arange(64.0))
        return dict(train=numbers, val=numbers, test=numbers)

module = Numbers(batch_size=4, num_workers=2)
module.setup("fit")
"""


def run_with_numbers(script: str, cwd: Path) -> tuple[int, str]:
    """`script` after a data module of 64 numbers with 2 workers is set up, in a process of its
    own; one still running after 60 s fails the test with its stacks (killing.finish)."""
    process = subprocess.Popen(
        [sys.executable, "-c", NUMBERS.format(package=PACKAGE) + script], cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    return finish(process, timeout=60)


LOADER_ALIVE_AT_EXIT = """
loader = module.train_dataloader()
batches = iter(loader)
next(batches)
kept = [loader, batches]
kept.append(kept)  # a cycle: only the garbage collector, which exit does not wait for, frees it
print("a batch loaded", flush=True)
"""


def test_a_loader_still_alive_at_exit_does_not_keep_the_process_waiting(tmp_path: Path) -> None:
    """Workers ignore SIGTERM (data.base.init_worker), which is how Python's exit ends them."""
    code, output = run_with_numbers(LOADER_ALIVE_AT_EXIT, tmp_path)
    assert code == 0 and "a batch loaded" in output, output[-3000:]


WORKERS_UNDER_DISTRIBUTED = """
dist.init_process_group("gloo", init_method="file://{rendezvous}", rank=0, world_size=1)
loader = module.train_dataloader()
start = loader.multiprocessing_context
assert (start is not None and start.get_start_method() == "forkserver") == FORK_MAY_HANG, start
received = []
signal.signal(signal.SIGTERM, lambda number, frame: received.append(number))
batches = iter(loader)
seen = [next(batches)[0]]
os.killpg(0, signal.SIGTERM)  # as `timeout`, SLURM and Kubernetes send it
seen += [batch[0] for batch in batches]
assert received == [signal.SIGTERM], received
assert sorted(torch.cat(seen).tolist()) == list(range(64)), "every batch came"
print("every batch after the signal", flush=True)
"""


def test_loader_workers_under_torch_distributed_start_safely_and_outlive_a_stop_signal(
    tmp_path: Path,
) -> None:
    """A forked worker can hang for ever on Python before 3.11.10 when another thread held an
    interpreter lock at the fork (CPython gh-112275; torch.distributed's threads do): there the
    workers come from a forkserver. Either way a SIGTERM to the whole group reaches the run, which
    decides where to stop, and leaves the workers serving it."""
    script = WORKERS_UNDER_DISTRIBUTED.replace("{rendezvous}", str(tmp_path / "rendezvous"))
    code, output = run_with_numbers(script, tmp_path)
    assert code == 0 and "every batch after the signal" in output, output[-3000:]
