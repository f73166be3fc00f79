"""What a sweep job hands back to the sweep that launched it, as JSON in the job's folder rather
than a pickle: a job on a cluster returns through a shared file system, and a launcher that
unpickled what it found there (submitit's result files) would run whatever a pickle put there
names. The job writes `job_return.json` (its status, its value for the sweeper, or its error's
kind and message); the launcher reads it back as a regular file of the job's folder, of bounded
size, and rebuilds Hydra's JobReturn from it: plain values only, one error kind from a fixed
table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from ..data.folder_files import read_bounded
from ..errors import ConfigError, TrainingError
from ..files import write_text_atomically
from ..run.lock import FolderInUse

RETURN_FILE = "job_return.json"
MOST_BYTES = 1 << 20


class TrialPruned(Exception):
    """A trial that Optuna's pruner stopped (the sweeper tells it apart by this name)."""


class JobFailed(Exception):
    """A job's error of a kind that is not rebuilt: its kind and message."""


# The errors rebuilt as themselves: the sweeper treats these apart from any other failure.
KINDS: dict[str, type[Exception]] = {
    "ConfigError": ConfigError, "TrainingError": TrainingError, "FolderInUse": FolderInUse,
    "TrialPruned": TrialPruned,
}  # fmt: skip


class UnreadableReturn(Exception):
    """A job folder whose job_return.json is missing, not a regular file, too large or not the
    record a job writes."""


def plain(value: Any) -> Any:
    """The value a sweeper can get back: a number (NaN and infinities too), a string, a bool or
    None; anything else as its text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def write_job_return(job_return: JobReturn) -> None:
    """In the job: its outcome beside its run, in its output folder."""
    if job_return.hydra_cfg is None:
        return
    output_dir = Path(str(job_return.hydra_cfg.hydra.runtime.output_dir))
    if job_return.status == JobStatus.COMPLETED:
        record = {"status": "COMPLETED", "value": plain(job_return._return_value)}
    else:
        error = job_return._return_value
        record = {"status": "FAILED", "kind": type(error).__name__, "message": str(error)}
    if output_dir.is_dir():
        write_text_atomically(json.dumps(record) + "\n", output_dir / RETURN_FILE)


def read_small_file(path: Path) -> bytes:
    """A file of a sweep's folders, opened without following a link, as a regular file of at most
    MOST_BYTES (`read_bounded`); any failure is one ValueError that says what the file is not."""
    try:
        return read_bounded(path, MOST_BYTES, path.name, "not a job's record", follow_links=False)
    except ConfigError as error:
        raise ValueError(str(error).rstrip(".")) from None


def read_small_json(path: Path) -> Any:
    """A JSON file of a sweep's folders (`read_small_file`); any failure is one ValueError."""
    data = read_small_file(path)
    try:
        value = json.loads(data)
        json.dumps(value, ensure_ascii=False).encode()  # a lone surrogate ("\ud800") is no text
    except Exception as error:  # json's decoding and recursion errors, and that, alike
        reason = (str(error).splitlines() or [type(error).__name__])[0][:200]
        raise ValueError(f"{path.name} is not JSON of UTF-8 text ({reason})") from None
    return value


def read_record(job_dir: Path) -> dict[str, Any]:
    """The job's record (`read_small_json`), checked to be one."""
    try:
        record = read_small_json(job_dir / RETURN_FILE)
    except ValueError as error:
        raise UnreadableReturn(str(error)) from None
    try:
        if not isinstance(record, dict) or record.get("status") not in ("COMPLETED", "FAILED"):
            raise ValueError("not a job's record")
        if record["status"] == "FAILED" and not all(
            isinstance(record.get(key), str) for key in ("kind", "message")
        ):
            raise ValueError("a failure without its kind and message")
    except ValueError as error:
        raise UnreadableReturn(f"{RETURN_FILE} is not a job's record ({error})") from None
    return record


def read_job_return(job_dir: Path, overrides: list[str]) -> JobReturn:
    """On the launcher's side: the JobReturn of the job that ran in `job_dir`."""
    record = read_record(job_dir)
    returned = JobReturn(
        overrides=overrides, working_dir=str(job_dir),
        hydra_cfg=OmegaConf.create(dict(hydra=dict(runtime=dict(output_dir=str(job_dir))))),
    )  # fmt: skip
    if record["status"] == "COMPLETED":
        returned.status, returned.return_value = JobStatus.COMPLETED, plain(record.get("value"))
    else:
        kind, message = record["kind"], record["message"]
        error = KINDS[kind](message) if kind in KINDS else JobFailed(f"{kind}: {message}")
        returned.status, returned.return_value = JobStatus.FAILED, error
    return returned
