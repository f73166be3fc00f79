"""The scheduler's job a sweep submitted for a job folder, recorded there as soon as the scheduler
took it, before the job starts and holds the folder (`run/lock.py`): a search run again after its
driver was killed asks the scheduler about that job, and waits for it, instead of submitting the
trial a second time."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..files import write_text_atomically
from .returns import read_small_json

QUEUED_FILE = "queued_job.json"
SLURM_JOB_ID = re.compile(r"\d{1,12}(_\d{1,9})?")


def record_queued(job_dir: Path, slurm_job: str) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(json.dumps({"slurm_job": slurm_job}) + "\n", job_dir / QUEUED_FILE)


def queued_job(job_dir: Path) -> str | None:
    """The SLURM job recorded for the folder; None where there is none, or the record is not one
    (it is only a hint: the scheduler has the last word)."""
    try:
        record = read_small_json(job_dir / QUEUED_FILE)
    except ValueError:
        return None
    job = record.get("slurm_job") if isinstance(record, dict) else None
    return job if isinstance(job, str) and SLURM_JOB_ID.fullmatch(job) else None
