"""Hydra callbacks for multiruns. Imported at every start: no torch, no Lightning here."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

from ..errors import ConfigError, TrainingError
from ..files import write_text_atomically
from ..run.settings import check_run_settings
from .report import draw_summary, short_labels, significant
from .returns import read_small_file, read_small_json

log = logging.getLogger(__name__)

SUBPROCESS_DDP_TARGETS = ("DDPStrategy",)
CLUSTER_LAUNCHERS = ("SlurmLauncher",)
# An Optuna trial stopped early by the pruner: finished as intended, not failed.
PRUNED = "PRUNED"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# Failed jobs named in the error line; the summary lists them all.
NAMED_FAILURES = 5


def launches_ddp_subprocesses(cfg: DictConfig) -> bool:
    """True when Lightning would start DDP children by re-running the command line."""
    strategy = cfg.trainer.get("strategy", "auto")
    devices = cfg.trainer.get("devices", 1)
    one = isinstance(devices, (list, ListConfig)) and len(devices) == 1
    many = devices not in (1, "1") and not one
    if isinstance(strategy, str):
        return strategy in ("ddp", "auto") and many
    target = str(strategy.get("_target_", ""))
    return (
        target.endswith(SUBPROCESS_DDP_TARGETS) and strategy.get("start_method", "popen") == "popen"
    )


def ddp_multirun_problem(cfg: DictConfig, launcher_target: str) -> str | None:
    if not launches_ddp_subprocesses(cfg) or launcher_target.endswith(CLUSTER_LAUNCHERS):
        return None
    return (
        f"trainer.strategy={OmegaConf.select(cfg, 'trainer.strategy._target_', default=cfg.trainer.strategy)} "
        f"with trainer.devices={cfg.trainer.devices} cannot run inside a -m multirun on this "
        "launcher: Lightning's DDP re-runs the whole command, sweep included, in each child "
        "process (Lightning issue #11300). Use strategy=ddp_spawn for sweeps on one machine, or "
        "hydra/launcher=slurm with one task per device."
    )


def shared_settings_problem(config: DictConfig) -> str | None:
    """What the run's own checks refuse in the settings that every job of the multirun shares
    (its config without the swept keys): each job would fail the same way."""
    if OmegaConf.select(config, "trainer") is None:
        return None  # a command without a trainer (export, prepare) checks no run settings
    try:
        check_run_settings(config)
    except ConfigError as error:
        return str(error)
    return None


MOST_JOBS_CHECKED = 256  # each costs a composition of the config (Hydra composes each once more)


def swept_settings_problem(config: DictConfig) -> str | None:
    """What the run's own checks refuse in any one job of a grid (the basic sweeper's), found
    before the first job trains: a bad value late in a list would otherwise fail only after the
    jobs before it."""
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
    if OmegaConf.select(config, "trainer") is None or sweeper != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [*(f"{key}={value}" for key, value in params.items()), *config.hydra.overrides.task]
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}
    jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    if len(jobs) < 2 or len(jobs) > MOST_JOBS_CHECKED:
        return None
    for number, job in enumerate(jobs):
        try:
            check_run_settings(loader.load_sweep_config(config, list(job)))
        except ConfigError as error:
            values = ",".join(item for item in job if item.split("=", 1)[0] in swept)
            return f"job #{number} ({values}) would be refused: {error}"
    return None


class MultirunGuard(Callback):
    """Refuses, before any job starts, a multirun that every job would fail: shared settings a
    run cannot use, or jobs that would start DDP subprocesses."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = str(config.hydra.launcher.get("_target_", ""))
        problem = (
            ddp_multirun_problem(config, launcher)
            or shared_settings_problem(config)
            or swept_settings_problem(config)
        )
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(1)


def read_json(path: Path) -> dict[str, Any]:
    """A job's record (its status, its metrics), or {} where it is missing or not an object."""
    try:
        record = read_small_json(path)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def read_overrides(path: Path) -> list[str]:
    """A job's overrides as written (an override may hold an interpolation that only its job's
    config resolves); one that is not a list of overrides reads as its own line."""
    try:
        stored = OmegaConf.to_container(OmegaConf.create(read_small_file(path).decode()))
    except Exception:  # YAML's and OmegaConf's errors alike: the summary is written anyway
        return [f"(unreadable {path.parent.name}/{path.name})"]
    return [str(o) for o in stored] if isinstance(stored, list) else [f"(no list in {path.name})"]


def record_job_status(output_dir: Path, status: str, reason: str | None = None) -> None:
    """`job_status.json` in a job's folder: what the summary reports for it, and why."""
    if output_dir.is_dir():
        record = {"status": status} if reason is None else {"status": status, "reason": reason}
        write_text_atomically(json.dumps(record) + "\n", output_dir / "job_status.json")


def record_job_ended_outside(job_dir: Path, overrides: list[str], status: str, reason: str) -> None:
    """The status of a job that its scheduler ended before the job could record one (SLURM's
    CANCELLED, TIMEOUT, ...), and, for a job that never started, its overrides as Hydra records
    them: the summary lists it either way."""
    recorded = job_dir / ".hydra" / "overrides.yaml"
    if not recorded.is_file():
        recorded.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(OmegaConf.to_yaml(OmegaConf.create(overrides)), recorded)
    record_job_status(job_dir, status, reason)


def returned_to_sweeper(config: DictConfig, job_return: JobReturn) -> JobReturn:
    """A failed job as the sweeper should get it back. Hydra's basic sweeper would raise the first
    failure once its batch has run, skipping on_multirun_end (no summary picture) and printing
    lines of its own; the failure is recorded in the job's folder and reported in one line by
    on_multirun_end, so the job goes back to it as finished. Other sweepers (Optuna) get the
    failure."""
    if (
        job_return.status == JobStatus.FAILED
        and config.hydra.sweeper.get("_target_") == BASIC_SWEEPER
    ):
        job_return.status, job_return.return_value = JobStatus.COMPLETED, None
    return job_return


def status_stamps(sweep_dir: Path) -> dict[Path, int]:
    """When each job's status was last recorded: a stamp that changed is this launch's."""
    stamps = {}
    for path in sweep_dir.glob("*/job_status.json"):
        with contextlib.suppress(OSError):
            stamps[path.parent] = path.stat().st_mtime_ns
    return stamps


class SweepSummary(Callback):
    """After a multirun: summary.csv, summary.md and summary.png in the sweep directory, one row
    (or bar) per job with its overrides, status, metrics and run directory. Jobs of this launch
    that failed then end the command with one `error:` line naming them, and exit code 1."""

    def __init__(self) -> None:
        self.stamps_before: dict[Path, int] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.stamps_before = status_stamps(Path(config.hydra.sweep.dir))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """Record the job's status, and name a failed job at once."""
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        output_dir = Path(config.hydra.runtime.output_dir)
        error = job_return._return_value
        if job_return.status == JobStatus.FAILED and type(error).__name__ == "TrialPruned":
            record_job_status(output_dir, PRUNED, str(error))
        elif job_return.status == JobStatus.FAILED:
            # The project's own errors say what is wrong; any other needs its type to be read.
            ours = isinstance(error, (ConfigError, TrainingError))
            reason = str(error) if ours else f"{type(error).__name__}: {error}"
            log.error(
                "Job #%s (%s) failed: %s. Its log: %s",
                config.hydra.job.get("num", "?"),
                " ".join(job_return.overrides or []),
                reason,
                output_dir / f"{config.get('task_name', 'train')}.log",
            )
            record_job_status(output_dir, job_return.status.name, reason)
            returned_to_sweeper(config, job_return)
        else:
            record_job_status(output_dir, job_return.status.name)
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir)
        if rows:
            write_summary(sweep_dir, rows, config.get("optimized_metric"))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir)
        if not rows:
            return
        metric = config.get("optimized_metric")
        write_summary(sweep_dir, rows, metric)
        draw_summary_picture(sweep_dir, rows, config)
        log.info("Sweep summary: %s (%d jobs)", sweep_dir / "summary.md", len(rows))
        recorded_now = {
            job_dir for job_dir, stamp in status_stamps(sweep_dir).items()
            if self.stamps_before.get(job_dir) != stamp
        }  # fmt: skip
        launched = [row for row in rows if Path(row["run_dir"]) in recorded_now]
        failed = [row for row in launched if row["status"] not in ("COMPLETED", PRUNED)]
        if failed:
            print(f"error: {failures(failed, len(launched), sweep_dir)}", file=sys.stderr)
            sys.exit(1)


def rounded(overrides: str) -> str:
    """`model.optimizer.lr=0.0012345 seed=2` -> `model.optimizer.lr=0.00123 seed=2`."""
    pairs = (override.partition("=") for override in overrides.split())
    return " ".join(f"{key}={significant(value)}" for key, _, value in pairs) or "no overrides"


def failures(failed: list[dict[str, Any]], launched: int, sweep_dir: Path) -> str:
    """One line: how many of this launch's jobs failed (or ended otherwise: CANCELLED, ...),
    which, and the first one's error."""
    named = ", ".join(
        f"#{row['job']} ({rounded(row['overrides'])})"
        + (f" {row['status']}" if row["status"] != "FAILED" else "")
        for row in failed[:NAMED_FAILURES]
    )
    more = f" and {len(failed) - NAMED_FAILURES} more" if len(failed) > NAMED_FAILURES else ""
    first = " ".join(str(failed[0]["reason"] or "no error recorded").split())
    first = first if len(first) <= 300 else first[:299] + "…"
    ended = "failed" if all(row["status"] == "FAILED" for row in failed) else "did not complete"
    return (
        f"{len(failed)} of {launched} jobs {ended}: {named}{more}. Job #{failed[0]['job']}: "
        f"{first.rstrip('.')}. Summary: {sweep_dir / 'summary.md'}; each job's log is in its "
        "folder."
    )


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory; `overrides` keeps what tells the jobs apart."""
    jobs = []
    for overrides_file in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")):
        overrides = read_overrides(overrides_file)
        jobs.append((overrides_file.parents[1], [o for o in overrides if "optuna_trial." not in o]))
    shared = (
        set.intersection(*(set(overrides) for _, overrides in jobs)) if len(jobs) > 1 else set()
    )
    rows = []
    for job_dir, overrides in jobs:
        status = read_json(job_dir / "job_status.json")
        rows.append(
            {
                "job": int(job_dir.name) if job_dir.name.isdigit() else job_dir.name,
                "overrides": " ".join(o for o in overrides if o not in shared),
                "status": status.get("status", "UNKNOWN"),
                "reason": status.get("reason"),
                "run_dir": str(job_dir),
                "metrics": read_json(job_dir / "metrics.json"),
            }
        )
    return sorted(rows, key=lambda row: str(row["job"]).zfill(6))


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]], metric: str | None) -> None:
    names = sorted({name for row in rows for name in row["metrics"]})
    if metric in names:
        names.remove(metric)
        names.insert(0, metric)
    header = ["job", "overrides", "status", *names, "run_dir"]
    table = [
        [row["job"], row["overrides"], row["status"]]
        + [row["metrics"].get(name, "") for name in names]
        + [row["run_dir"]]
        for row in rows
    ]
    summary = io.StringIO()
    writer = csv.writer(summary)
    writer.writerow(header)
    writer.writerows(table)
    write_text_atomically(summary.getvalue(), sweep_dir / "summary.csv")
    write_text_atomically(markdown_table(rows, metric), sweep_dir / "summary.md")


def markdown_table(rows: list[dict[str, Any]], metric: str | None) -> str:
    """summary.md, to read in a terminal: each job's parameters (short names, values rounded),
    status and optimized metric, in aligned columns; the other metrics and the run directories
    are in summary.csv."""
    header = ["job", "overrides", "status", *([metric] if metric else [])]
    labels = short_labels([str(row["overrides"]) for row in rows])
    table = [
        [str(row["job"]), label, str(row["status"])]
        + ([significant(row["metrics"].get(metric, "-"))] if metric else [])
        for row, label in zip(rows, labels, strict=True)
    ]
    table = [[cell.replace("|", "\\|") for cell in cells] for cells in table]
    widths = [max(len(cells[i]) for cells in [header, *table]) for i in range(len(header))]

    def aligned(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    lines = [aligned(header), aligned(["-" * w for w in widths]), *map(aligned, table)]
    lines += ["", "Every metric and each job's run directory: summary.csv."]
    return "\n".join(lines) + "\n"


def draw_summary_picture(sweep_dir: Path, rows: list[dict[str, Any]], config: DictConfig) -> None:
    metric = config.get("optimized_metric")
    if not metric:
        return
    mode = str(OmegaConf.select(config, "monitor.mode", default="min"))
    try:
        draw_summary(sweep_dir / "summary.png", rows, str(metric), mode)
    except Exception as error:  # a picture that cannot be drawn never fails the sweep
        log.warning("summary.png not drawn: %s", error)
