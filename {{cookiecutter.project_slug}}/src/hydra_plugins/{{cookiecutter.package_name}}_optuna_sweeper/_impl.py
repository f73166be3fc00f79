"""The sweeper's work, imported only when a sweep starts (it imports optuna).

Each batch of trials is asked from the study, launched as Hydra jobs, and told back. A job
reports intermediate values through the `OptunaPruning` callback, which may stop it early.

A launch killed while its trials' jobs ran (a driver killed while its SLURM jobs go on) leaves
them running in the study. The same command, run again, waits for a trial whose job still holds
its folder and takes the result that job recorded; a trial whose job recorded none is launched
again, resuming in its folder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
)
from {{ cookiecutter.package_name }}.run.lock import (
    FolderInUse,
    held,
    hold,
    holder,
    holder_job,
)
from {{ cookiecutter.package_name }}.sweeps.queued import (
    queued_job,
)
from {{ cookiecutter.package_name }}.sweeps.summary import (
    PRUNED,
    read_json,
    record_job_status,
)

log = logging.getLogger(__name__)

FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
AnyTrial = optuna.Trial | optuna.trial.FrozenTrial
# In the sweep folder: the study whose trials it holds, and the settings that define that study.
STUDY_RECORD = "optuna_study.json"
# How often a trial's job left running by an earlier launch is looked at while the search waits.
WAIT_POLL_S = 2.0


def slurm_job_alive(job_id: str) -> Any:
    """How SLURM shows the job where it has not ended, else None (`_jobs.alive`: the SLURM
    launcher's, imported only where a trial's folder names a SLURM job)."""
    from hydra_plugins.{{ cookiecutter.package_name }}_slurm_launcher._jobs import (
        alive,
    )

    return alive(job_id)


# A trial whose job found its folder held, and then no holder to wait for nor a result, is launched
# again this many times before it is marked failed (a lock this machine cannot see the holder of).
RELAUNCHES_AFTER_REFUSAL = 2

# Optuna's messages go to the sweep's log with everything else, not to stderr.
optuna.logging.disable_default_handler()
optuna.logging.enable_propagation()


def distribution(override: Override) -> optuna.distributions.BaseDistribution:
    value = override.value()
    if isinstance(value, ChoiceSweep):
        return optuna.distributions.CategoricalDistribution(list(override.sweep_iterator()))  # type: ignore[arg-type]
    if isinstance(value, RangeSweep):
        start, stop, step = int(value.start or 0), int(value.stop or 0), int(value.step or 1)
        last = start + (stop - 1 - start) // step * step  # Hydra's range excludes `stop`
        return optuna.distributions.IntDistribution(start, last, step=step)
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return optuna.distributions.IntDistribution(value.start, value.end, log=log_scale)
        return optuna.distributions.FloatDistribution(
            float(value.start or 0.0), float(value.end or 0.0), log=log_scale
        )
    raise ConfigError(
        f"{override.input_line}: use choice(...), range(...), interval(...) or "
        "tag(log, interval(...)) to define a search dimension."
    )


def representative(dimension: optuna.distributions.BaseDistribution) -> Any:
    """A value of a search dimension: its first choice, or its lower end."""
    if isinstance(dimension, optuna.distributions.CategoricalDistribution):
        return dimension.choices[0]
    return dimension.low  # type: ignore[attr-defined]


def differences(held: dict[str, Any], study: dict[str, Any]) -> list[str]:
    """What sets `study` apart from the study `held` (both as recorded in STUDY_RECORD), in the
    settings a user changes."""
    was, now = held.get("settings", {}), study["settings"]
    changed = [
        f"hydra.sweeper.{key}={new}, not {old}"
        for key, old, new in (
            ("study_name", str(held.get("study_name")).rsplit("-", 1)[0],
             study["study_name"].rsplit("-", 1)[0]),
            ("storage", held.get("storage"), study["storage"]),
            ("direction", was.get("direction"), now["direction"]),
        )
        if old != new
    ]  # fmt: skip
    params, held_params = now["params"], was.get("params", {})
    changed += [
        f"the search space of {key}"
        for key in sorted(set(params) | set(held_params))
        if params.get(key) != held_params.get(key)
    ]
    changed += sorted(set(was.get("overrides", [])) ^ set(now["overrides"]))
    return changed


def quote(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value)


class OptunaSweeperImpl:
    def __init__(
        self,
        storage: str | None,
        study_name: str,
        direction: str,
        n_trials: int,
        n_jobs: int,
        seed: int | None,
        pruner: dict[str, Any] | None,
        params: dict[str, str] | None,
        max_failures_in_a_row: int,
    ) -> None:
        self.storage = storage
        self.study_name = study_name
        self.direction = direction
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.seed = seed
        self.pruner = pruner
        self.params = dict(params or {})
        self.max_failures_in_a_row = max_failures_in_a_row
        self.name = study_name

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _search_space(
        self, arguments: list[str]
    ) -> tuple[dict[str, optuna.distributions.BaseDistribution], list[str]]:
        """`params` plus sweep overrides from the command line; a plain `key=value` on the
        command line pins that key and takes it out of the search."""
        parser = OverridesParser.create()
        space: dict[str, optuna.distributions.BaseDistribution] = {}
        for key, value in self.params.items():
            override = parser.parse_override(f"{key}={value}")
            space[override.get_key_element()] = distribution(override)
        fixed: list[str] = []
        for override in parser.parse_overrides(arguments):
            key = override.get_key_element()
            if override.is_sweep_override():
                space[key] = distribution(override)
            else:
                space.pop(key, None)
                fixed.append(str(override.input_line))
        return space, fixed

    def _settings(self) -> dict[str, Any]:
        """Everything that defines the search: the command's overrides that change what is
        trained, the search space, the direction."""
        hydra = self.config.hydra
        excluded = set(hydra.job.config.override_dirname.exclude_keys)
        overrides = sorted(
            str(o)
            for o in hydra.overrides.task
            if str(o).split("=")[0].lstrip("+~") not in excluded
        )
        return {"overrides": overrides, "params": self.params, "direction": self.direction}

    def _identity(self, settings: dict[str, Any]) -> str:
        """The study's name: `study_name` and a digest of its settings, so that only the same
        command continues a study and another one never joins it."""
        digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.study_name}-{digest}"

    def _check_folder(self, sweep_dir: Path, study: dict[str, Any]) -> None:
        """A sweep folder holds the trials of one study, numbered from 0: another study there
        would train its trials in the folders of the first one's (same numbers, other
        parameters), so it is refused."""
        record = sweep_dir / STUDY_RECORD
        if record.is_file():
            held = json.loads(record.read_text())
            changed = differences(held, study)
            if not changed:
                return
            what = f"the Optuna study {held.get('study_name')} of other settings"
            what += f" ({'; '.join(changed)})"
        elif any(sweep_dir.glob("*/.hydra")):
            what = "the jobs of another sweep"
        else:
            return
        raise ConfigError(
            f"{sweep_dir} holds {what}: give this search a folder of its own with "
            "hydra.sweep.dir=<folder>, or delete that folder to start over."
        )

    def _check_trials_known(self, sweep_dir: Path, study: optuna.Study) -> None:
        """The study numbers its next trial after those it holds: a folder with trials it does
        not hold (a study kept in memory, or a storage deleted since) would be trained over."""
        numbers = [
            int(job.parent.name) for job in sweep_dir.glob("*/.hydra") if job.parent.name.isdigit()
        ]
        if numbers and max(numbers) >= len(study.trials):
            where = self.storage or "memory (hydra.sweeper.storage=null)"
            raise ConfigError(
                f"{sweep_dir} holds trials up to #{max(numbers)}, which the study {self.name} in "
                f"{where} does not (it holds {len(study.trials)}): delete that folder to start "
                "over, or give this search a folder of its own with hydra.sweep.dir=<folder>."
            )

    def _check_trial_config(self, fixed: list[str], space: dict[str, Any]) -> None:
        """Compose one trial's config before the study starts, so that a search key the config
        lacks fails now, in one line, not in every trial."""
        sample = [f"{key}={quote(representative(dimension))}" for key, dimension in space.items()]
        self.hydra_context.config_loader.load_sweep_config(self.config, fixed + sample)

    def _storage_held(self) -> contextlib.AbstractContextManager[None]:
        """One search at a time on a study file, whatever its sweep folder: a lock beside the
        SQLite file, taken before the study is made or read. (A database server's storage has no
        file to lock: there, only the sweep folder is held.)"""
        if not (self.storage and self.storage.startswith("sqlite:///")):
            return contextlib.nullcontext()
        database = Path(self.storage.removeprefix("sqlite:///"))
        database.parent.mkdir(parents=True, exist_ok=True)
        return held(
            database.with_name(f"{database.name}.lock"), f"the study storage {self.storage}",
            "a search of its study",
            "give this search a storage of its own (hydra.sweeper.storage=sqlite:///<file>)",
        )  # fmt: skip

    def _study(self) -> optuna.Study:
        pruner = (
            optuna.pruners.MedianPruner(**self.pruner)
            if self.pruner
            else optuna.pruners.NopPruner()
        )
        return optuna.create_study(
            study_name=self.name,
            storage=self.storage,
            sampler=optuna.samplers.TPESampler(seed=self.seed),
            pruner=pruner,
            direction=self.direction,  # type: ignore[arg-type]
            load_if_exists=True,
        )

    def _left_running(
        self, study: optuna.Study, space: dict[str, Any]
    ) -> list[optuna.trial.FrozenTrial]:
        """The trials an earlier launch started and never finished (it was killed, or lost its
        node): each is resumed in its own folder, from its newest checkpoint, with its
        parameters. One without this search's parameters cannot be, and is marked failed."""
        left = []
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if trial.params.keys() == space.keys():
                left.append(trial)
                continue
            log.warning(
                "Trial %d was left running by an earlier launch without this search's "
                "parameters: marked failed.",
                trial.number,
            )
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        return left

    def _ask(self, study: optuna.Study, space: dict[str, Any]) -> optuna.Trial:
        """The next trial, sampled with the seed plus its number: a search stopped and run again
        samples what it would have sampled, and a continued one never repeats its first trials."""
        if self.seed is not None:
            study.sampler = optuna.samplers.TPESampler(seed=self.seed + len(study.trials))
        return study.ask(space)

    def _next_batch(
        self, study: optuna.Study, space: dict[str, Any], left: list[AnyTrial]
    ) -> list[AnyTrial]:
        """Trials left running first, consecutive ones together (their jobs take the folders
        numbered from the first), then new ones, up to n_jobs at a time."""
        if left:
            batch: list[AnyTrial] = [left.pop(0)]
            while left and len(batch) < self.n_jobs and left[0].number == batch[-1].number + 1:
                batch.append(left.pop(0))
            return batch
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        return [self._ask(study, space) for _ in range(min(self.n_jobs, self.n_trials - done))]

    def sweep(self, arguments: list[str]) -> None:
        for key in ("n_trials", "n_jobs", "max_failures_in_a_row"):
            if getattr(self, key) < 1:
                raise ConfigError(
                    f"hydra.sweeper.{key}={getattr(self, key)}: use a whole number of 1 or more."
                )
        settings = self._settings()
        self.name = self._identity(settings)
        study_record = {"study_name": self.name, "storage": self.storage, "settings": settings}
        sweep_dir = Path(self.config.hydra.sweep.dir)
        self._check_folder(sweep_dir, study_record)
        space, fixed = self._search_space(arguments)
        if not space:
            raise ConfigError(
                "nothing to search: set hydra.sweeper.params, or pass a sweep override such as "
                "model.optimizer.lr=interval(0.0001,0.01)."
            )
        self._check_trial_config(fixed, space)
        with self._storage_held():
            study = self._study()
            self._check_trials_known(sweep_dir, study)
            with hold(sweep_dir, elsewhere="give it hydra.sweep.dir=<folder>"):
                (sweep_dir / STUDY_RECORD).write_text(json.dumps(study_record, indent=2) + "\n")
                self._run_trials(study, space, fixed)

    def _run_trials(self, study: optuna.Study, space: dict[str, Any], fixed: list[str]) -> None:
        left = self._left_running(study, space)
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        if done or left:
            log.info(
                "Study %r continues: %d of %d trials finished%s.",
                self.name, done, self.n_trials, self._left_said(left),
            )  # fmt: skip
        left_running: list[AnyTrial] = [t for t in left if self._result_left(study, t) is None]
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        failed_in_a_row = 0
        refusals: dict[int, int] = {}
        while left_running or done < self.n_trials:
            trials = self._next_batch(study, space, left_running)
            batch = [fixed + self._trial_overrides(trial) for trial in trials]
            # Job directories by trial number: a continued study never reuses a finished trial's.
            returns = self.launcher.launch(batch, initial_job_idx=trials[0].number)
            for trial, job in zip(trials, returns, strict=True):
                state = self._tell(study, trial, job, refusals)
                if state is None:  # launched again, after the job that held its folder
                    left_running = sorted([*left_running, trial], key=lambda t: t.number)
                    continue
                failed = state == optuna.trial.TrialState.FAIL
                failed_in_a_row = failed_in_a_row + 1 if failed else 0
            done = len(study.get_trials(deepcopy=False, states=FINISHED))
            if failed_in_a_row >= self.max_failures_in_a_row:
                log.error(
                    "Stopped the study: its last %d trials in a row failed (%d of %d trials "
                    "finished). Fix what failed, then run the same command to go on.",
                    failed_in_a_row,
                    done,
                    self.n_trials,
                )
                break
        self._report(study)

    def _trial_overrides(self, trial: AnyTrial) -> list[str]:
        overrides = [f"{key}={quote(value)}" for key, value in trial.params.items()]
        overrides.append(f"++optuna_trial.number={trial.number}")
        overrides.append(f"++optuna_trial.trial_id={trial._trial_id}")
        if self.storage:
            overrides += [
                f"++optuna_trial.storage={quote(self.storage)}",
                f"++optuna_trial.study_name={quote(self.name)}",
            ]
            overrides += [f"++optuna_trial.pruner.{k}={v}" for k, v in (self.pruner or {}).items()]
        return overrides

    def _trial_dir(self, trial: AnyTrial) -> Path:
        """Where the trial's job runs: the sweep folder's `<trial number>/` (initial_job_idx)."""
        return Path(self.config.hydra.sweep.dir) / str(trial.number)

    def _job_alive(self, trial: AnyTrial) -> str | None:
        """The job of an earlier launch that still runs the trial, or waits in the scheduler's
        queue to (as the scheduler says, not as that launch last knew): "pending as SLURM job
        27", "running as process 123 on host"; None where there is none."""
        folder = self._trial_dir(trial)
        running = holder(folder)
        if running is not None:
            job = holder_job(running)
            return f"running as SLURM job {job}" if job else f"running as process {running}"
        queued = queued_job(folder)
        seen = slurm_job_alive(queued) if queued else None
        return f"{seen.state.lower()} as SLURM job {queued}" if seen else None

    def _left_said(self, left: list[optuna.trial.FrozenTrial]) -> str:
        alive = {trial.number: self._job_alive(trial) for trial in left}
        said = [
            f"trial {number} still {job}" if job else f"trial {number} to run again"
            for number, job in alive.items()
        ]
        return f"; {', '.join(said)}" if said else ""

    def _result_left(self, study: optuna.Study, trial: AnyTrial) -> optuna.trial.TrialState | None:
        """The result of the trial's job left by an earlier launch, told to the study: first,
        while that job still waits in the scheduler's queue or holds the trial's folder, the
        search waits for it to end (one line says which job). None where no job recorded a
        result: the trial is to be launched, resuming in its folder."""
        folder = self._trial_dir(trial)
        job = self._job_alive(trial)
        if job is not None:
            log.info(
                "Trial %d is still %s, started by an earlier launch of this search: waiting for "
                "it to end.", trial.number, job,
            )  # fmt: skip
            while self._job_alive(trial) is not None:
                time.sleep(WAIT_POLL_S)
        metrics = read_json(folder / "metrics.json")
        if metrics:
            metric = self.config.get("optimized_metric")
            log.info("Trial %d: its job of an earlier launch finished.", trial.number)
            state = self._tell_value(study, trial, metrics.get(str(metric)), folder)
            if state == optuna.trial.TrialState.COMPLETE:
                record_job_status(folder, JobStatus.COMPLETED.name)
            return state
        recorded = read_json(folder / "job_status.json")
        if recorded.get("status") == PRUNED:
            log.info("Trial %d pruned: %s", trial.number, recorded.get("reason"))
            study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
            return optuna.trial.TrialState.PRUNED
        return None

    def _tell_value(
        self, study: optuna.Study, trial: AnyTrial, value: Any, output_dir: Path | None
    ) -> optuna.trial.TrialState:
        """Tell the study the value the trial's run returned: a finite number completes the
        trial; anything else fails it, and its summary row (in `output_dir`) says why."""
        if isinstance(value, (int, float)) and math.isfinite(value):
            study.tell(trial.number, float(value))
            log.info("Trial %d: %s", trial.number, value)
            return optuna.trial.TrialState.COMPLETE
        reason = (
            f"the trial returned {value!r}, not a finite number: optimized_metric="
            f"{self.config.get('optimized_metric')} must name a metric the run reports"
        )
        log.error("Trial %d failed: %s.", trial.number, reason)
        if output_dir is not None:  # the job ended well: its summary row would say so
            record_job_status(output_dir, JobStatus.FAILED.name, reason)
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        return optuna.trial.TrialState.FAIL

    def _tell(
        self, study: optuna.Study, trial: AnyTrial, job: JobReturn, refusals: dict[int, int]
    ) -> optuna.trial.TrialState | None:
        """Tell the study how the trial's job ended; returns the trial's state. A job refused
        its folder, held by the trial's job of an earlier launch (which had waited in the
        queue), gives way to that job: its result is told instead, or, where it recorded none,
        None says the trial is to be launched again (`refusals` counts how often)."""
        if job.status == JobStatus.COMPLETED:
            output_dir = (
                Path(job.hydra_cfg.hydra.runtime.output_dir) if job.hydra_cfg is not None else None
            )
            return self._tell_value(study, trial, job.return_value, output_dir)
        state = optuna.trial.TrialState.FAIL
        if isinstance(job._return_value, FolderInUse):
            refusals[trial.number] = refusals.get(trial.number, 0) + 1
            if refusals[trial.number] <= RELAUNCHES_AFTER_REFUSAL:
                return self._result_left(study, trial)
            log.error("Trial %d failed: %s", trial.number, job._return_value)
        elif type(job._return_value).__name__ == "TrialPruned":
            state = optuna.trial.TrialState.PRUNED
            log.info("Trial %d pruned: %s", trial.number, job._return_value)
        else:
            log.error("Trial %d failed: %r", trial.number, job._return_value)
        study.tell(trial.number, state=state)
        return state

    def _report(self, study: optuna.Study) -> None:
        completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not completed:
            log.error("No trial of study %r completed.", self.name)
            return
        best = study.best_trial
        results = {
            "study_name": self.name,
            "storage": self.storage,
            "best_trial": best.number,
            "best_value": best.value,
            "best_params": best.params,
            "trials": {
                state.name: len(study.get_trials(states=(state,)))
                for state in optuna.trial.TrialState
            },
        }
        path = Path(self.config.hydra.sweep.dir) / "optimization_results.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(results), path)
        log.info(
            "Best trial %d: %s = %s with %s", best.number, self.direction, best.value, best.params
        )
        draw_study(study, path.parent, str(self.config.get("optimized_metric") or "objective"))


def draw_history(study: optuna.Study, objective: str = "objective") -> Any:
    """The study's optimization history, a matplotlib Figure: each completed trial's value by
    trial number (whole numbers on the axis), the best value so far, and each pruned trial at
    the last value it reported before it was stopped."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    trials = study.get_trials(deepcopy=False)
    completed = [
        (t.number, t.value)
        for t in trials
        if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None
    ]
    pruned = [
        t for t in trials if t.state == optuna.trial.TrialState.PRUNED and t.intermediate_values
    ]
    figure, axes = plt.subplots(figsize=(8, 5), layout="constrained")
    numbers = [number for number, _ in completed]
    values = [value for _, value in completed]
    better = max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min
    best = [better(values[: i + 1]) for i in range(len(values))]
    axes.plot(numbers, values, "o", color="#4c78a8", label="completed")
    axes.plot(numbers, best, drawstyle="steps-post", color="#d62728", label="best so far")
    if pruned:
        last = [t.intermediate_values[max(t.intermediate_values)] for t in pruned]
        axes.plot(
            [t.number for t in pruned], last, "x", color="#f2a541", markersize=8,
            markeredgewidth=2, label="pruned (last value reported)",
        )  # fmt: skip
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("trial")
    axes.set_ylabel(objective)
    axes.set_title(f"{objective} by trial ({study.direction.name.lower()})", fontsize=10)
    axes.legend(fontsize=8)
    return figure


# Parameter importances rank the parameters by how the objective varies among the completed
# trials: from fewer than this many, the ranking is noise.
LEAST_FOR_IMPORTANCES = 5


def draw_study(study: optuna.Study, folder: Path, objective: str = "objective") -> None:
    """`optimization_history.png` (draw_history), and Optuna's `param_importances.png` once
    LEAST_FOR_IMPORTANCES trials have completed (a log line says why it is not drawn before). A
    plot that cannot be drawn is named in a warning and never fails the sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    def importances(study: optuna.Study) -> Any:
        with warnings.catch_warnings():
            # Optuna's note that its plots are experimental leaves nothing to act on.
            warnings.simplefilter("ignore")
            return plots.plot_param_importances(study).figure

    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    drawings: list[tuple[str, Callable[[optuna.Study], Any]]] = [
        ("optimization_history.png", lambda study: draw_history(study, objective))
    ]
    if len(completed) < LEAST_FOR_IMPORTANCES:
        log.info(
            "param_importances.png not drawn: %d trial%s completed, and ranking the parameters "
            "takes %d.",
            len(completed),
            "" if len(completed) == 1 else "s",
            LEAST_FOR_IMPORTANCES,
        )
    elif study.best_trial.params:
        drawings.append(("param_importances.png", importances))
    for name, draw in drawings:
        try:
            figure = draw(study)
            figure.set_size_inches(8, 5)
            figure.savefig(folder / name, dpi=110, bbox_inches="tight")
            plt.close(figure)
        except Exception as error:
            plt.close("all")
            log.warning("%s not drawn: %s", name, error)
