"""Hydra callbacks for multiruns. Imported at every start: no torch, no Lightning here."""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .sweep_report import draw_summary, short_labels, significant

log = logging.getLogger(__name__)

SUBPROCESS_DDP_TARGETS = ("DDPStrategy",)
CLUSTER_LAUNCHERS = ("SlurmLauncher",)
# An Optuna trial stopped early by the pruner: finished as intended, not failed.
PRUNED = "PRUNED"


def launches_ddp_subprocesses(cfg: DictConfig) -> bool:
    """True when Lightning would start DDP children by re-running the command line."""
    strategy = cfg.trainer.get("strategy", "auto")
    devices = cfg.trainer.get("devices", 1)
    many = devices not in (1, "1", [0]) and not (isinstance(devices, list) and len(devices) == 1)
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
        "hydra/launcher=submitit_slurm with one task per device."
    )


class MultirunGuard(Callback):
    """Refuses, before any job starts, a multirun whose jobs would start DDP subprocesses."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problem = ddp_multirun_problem(config, str(config.hydra.launcher.get("_target_", "")))
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(1)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


class SweepSummary(Callback):
    """After a multirun: summary.csv, summary.md and summary.png in the sweep directory, one row
    (or bar) per job with its overrides, status, metrics and run directory."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """Record the job's status; name a failed job at once, since Hydra stops the sweep with
        the first failure's error once every job of the batch has run."""
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        status = {"status": job_return.status.name}
        output_dir = Path(config.hydra.runtime.output_dir)
        error = job_return._return_value
        if job_return.status == JobStatus.FAILED and type(error).__name__ == "TrialPruned":
            status = {"status": PRUNED, "reason": str(error)}
        elif job_return.status == JobStatus.FAILED:
            status["error"] = f"{type(error).__name__}: {error}"
            log.error(
                "Job #%s (%s) failed: %s. Its log: %s",
                config.hydra.job.get("num", "?"),
                " ".join(job_return.overrides or []),
                status["error"],
                output_dir / f"{config.get('task_name', 'train')}.log",
            )
        if output_dir.is_dir():
            (output_dir / "job_status.json").write_text(json.dumps(status) + "\n")
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
        failed = [row["job"] for row in rows if row["status"] not in ("COMPLETED", PRUNED)]
        log.info("Sweep summary: %s (%d jobs)", sweep_dir / "summary.md", len(rows))
        if failed:
            log.error("Failed jobs: %s", ", ".join(map(str, failed)))


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory; `overrides` keeps what tells the jobs apart."""
    jobs = []
    for overrides_file in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")):
        overrides = [str(o) for o in OmegaConf.load(overrides_file) or []]
        jobs.append((overrides_file.parents[1], [o for o in overrides if "optuna_trial." not in o]))
    shared = (
        set.intersection(*(set(overrides) for _, overrides in jobs)) if len(jobs) > 1 else set()
    )
    rows = [
        {
            "job": int(job_dir.name) if job_dir.name.isdigit() else job_dir.name,
            "overrides": " ".join(o for o in overrides if o not in shared),
            "status": read_json(job_dir / "job_status.json").get("status", "UNKNOWN"),
            "run_dir": str(job_dir),
            "metrics": read_json(job_dir / "metrics.json"),
        }
        for job_dir, overrides in jobs
    ]
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
    with (sweep_dir / "summary.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(table)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    labels = short_labels([str(row["overrides"]) for row in rows])
    for label, values in zip(labels, table, strict=True):
        cells = [significant(v) for v in [values[0], label, *values[2:]]]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")


def draw_summary_picture(sweep_dir: Path, rows: list[dict[str, Any]], config: DictConfig) -> None:
    metric = config.get("optimized_metric")
    if not metric:
        return
    mode = str(OmegaConf.select(config, "monitor.mode", default="min"))
    try:
        draw_summary(sweep_dir / "summary.png", rows, str(metric), mode)
    except Exception as error:  # a picture that cannot be drawn never fails the sweep
        log.warning("summary.png not drawn: %s", error)
