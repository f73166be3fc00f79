"""A throwaway single-node SLURM cluster on this machine, to try the cluster path (hydra/launcher=
slurm, scripts/slurm.sbatch, preemption and requeue) on a laptop or in CI, and for the tests.

    sudo apt-get install slurmctld slurmd slurm-client     # Debian/Ubuntu, once
    sudo python scripts/local_slurm.py start /tmp/slurm    # prints: export SLURM_CONF=...
    export SLURM_CONF=/tmp/slurm/slurm.conf
    {{ cookiecutter.package_name }}-train -m hydra/launcher=slurm trainer=cpu seed=1,2
    sudo python scripts/local_slurm.py stop /tmp/slurm

The cluster runs as root without munge, cgroups or accounting (slurmdbd): one node with this
machine's cores and memory, one partition `local`. Everything it writes stays in the folder.
A node failure can be tried: `scontrol update nodename=<node> state=down reason=<why>` requeues
its jobs (those that allow it) and keeps the node down until `state=resume`. A requeued job starts
again 21 s after its requeue (121 s on a default cluster). Where the cluster cannot start (not
root, the packages missing, a daemon that does not come up) it says so in one line and exits
with code 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel")
PARTITION = "local"


class ClusterError(Exception):
    """The cluster cannot start here; the message says why and what to do."""


def free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld and slurmd)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port < 65535:
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise ClusterError("no two free ports next to each other for slurmctld and slurmd.")


def memory_mb() -> int:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages // 2**20 * 0.9)


def config(folder: Path, host: str, port: int) -> str:
    cpus = os.cpu_count() or 1
    return f"""\
ClusterName=local
SlurmctldHost={host}
# Job ids from a block of their own per cluster: two clusters on one machine (the tests start one
# per pytest worker) would otherwise both run a job 1, and Lightning derives a DDP port from it.
FirstJobId={1 + port % 90 * 100}
SlurmctldPort={port}
SlurmdPort={port + 1}
AuthType=auth/none
# A requeued job waits until its revoked credential has expired: 20 s here instead of 120.
AuthInfo=cred_expire=20
CredType=cred/none
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
# A node set DOWN stays down until `scontrol update nodename=<node> state=resume`; one marked down
# for not answering comes back when it answers. (With 2, a DOWN node came back at its next answer
# to the controller, e.g. as its killed job's processes ended: within 0.1 s.)
ReturnToService=1
SchedulerType=sched/backfill
# The main scheduler every second (not 60): a requeued job starts once it may.
SchedulerParameters=bf_interval=1,sched_interval=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
KillWait=10
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb()} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def environment(folder: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}


def node_is_idle(folder: Path) -> bool:
    shown = subprocess.run(
        ["sinfo", "--noheader", "--format=%t"],
        env=environment(folder),
        capture_output=True,
        text=True,
        timeout=10,
    )
    return shown.returncode == 0 and shown.stdout.strip() in ("idle", "mix", "alloc")


def start(folder: Path, timeout: float = 60.0) -> None:
    if os.geteuid() != 0:
        raise ClusterError("the local cluster runs as root: run this script with sudo.")
    missing = [name for name in (*DAEMONS, *CLIENTS, "sinfo") if shutil.which(name) is None]
    if missing:
        raise ClusterError(
            f"{', '.join(missing)} not found: install them (Debian/Ubuntu: apt-get install "
            "slurmctld slurmd slurm-client)."
        )
    stop(folder, quiet=True)
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    (folder / "slurm.conf").write_text(config(folder.resolve(), host, free_port_pair()))
    conf = str(folder / "slurm.conf")
    for daemon in DAEMONS:
        # -c: a clean state (no jobs of an earlier cluster in this folder)
        flags = ["-c"] if daemon == "slurmctld" else []
        started = subprocess.run(
            [daemon, "-f", conf, *flags], capture_output=True, text=True, timeout=30
        )
        if started.returncode != 0:
            reason = (started.stderr or started.stdout).strip().splitlines()
            raise ClusterError(f"{daemon} did not start: {reason[-1] if reason else '?'}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node_is_idle(folder):
            print(f"export SLURM_CONF={conf}")
            return
        time.sleep(0.5)
    raise ClusterError(f"the node did not come up within {timeout:.0f} s; see {folder}/*.log.")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def end(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL whatever still runs after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def job_processes(conf: Path) -> list[int]:
    """Processes of this cluster's jobs, job steps included: they carry its SLURM_CONF and a
    SLURM_JOB_ID (or are its slurmstepd). Never this process or its parents."""
    own = {os.getpid(), os.getppid()}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            name = (proc / "comm").read_text().strip()
        except OSError:
            continue
        ours = f"SLURM_CONF={conf}".encode() in environ
        in_job = name == "slurmstepd" or any(v.startswith(b"SLURM_JOB_ID=") for v in environ)
        if ours and in_job and int(proc.name) not in own:
            found.append(int(proc.name))
    return found


def wait_for_empty_queue(folder: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(
            ["squeue", "--noheader", "--states=PENDING,RUNNING,COMPLETING,SUSPENDED"],
            env=environment(folder), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if listed.returncode != 0 or not listed.stdout.strip():
            return
        time.sleep(0.2)


def stop(folder: Path, quiet: bool = False) -> None:
    """Cancel every job, then stop both daemons and any job step left: nothing of the cluster
    keeps running."""
    conf = folder / "slurm.conf"
    if conf.is_file():
        subprocess.run(
            ["scancel", "--full", "--user=root"], env=environment(folder), capture_output=True,
            timeout=30,
        )  # fmt: skip
        wait_for_empty_queue(folder)
    pids = []
    for daemon in DAEMONS:
        with contextlib.suppress(OSError, ValueError):
            pids.append(int((folder / f"{daemon}.pid").read_text().strip()))
    end([pid for pid in pids if alive(pid)])
    if conf.is_file():
        end(job_processes(conf.resolve()), grace=2.0)
    if not quiet:
        print(f"stopped the cluster in {folder}")


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        print("usage: local_slurm.py start|stop <folder>", file=sys.stderr)
        return 2
    folder = Path(sys.argv[2]).absolute()
    try:
        (start if sys.argv[1] == "start" else stop)(folder)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
