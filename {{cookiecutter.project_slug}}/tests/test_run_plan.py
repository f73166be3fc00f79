"""Settings are typed once. The project's own settings have schemas (configs/schema.py), so Hydra
refuses a value of the wrong type, or a key that is no setting, while it composes, in one line;
the validation phase turns the composed config into a typed plan (run/plan.py) that the steps
after it take; only the recipes and the validation phase read the raw config."""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig

from {{ cookiecutter.package_name }}.command_errors import one_line
from {{ cookiecutter.package_name }}.recipes.train import train
from {{ cookiecutter.package_name }}.run.checks import check_config
from {{ cookiecutter.package_name }}.run.plan import (
    RunPlan,
    strategy_of,
)

from .helpers import PACKAGE, PROJECT_ROOT, compose_config, run_cli

SOURCE = PROJECT_ROOT / "src" / PACKAGE

MISTYPED = [
    ("train", "seed=abc", "seed='abc': use a whole number, or null."),
    ("train", "seed=1.5", "seed=1.5: use a whole number, or null."),
    ("train", "extend=maybe", "extend='maybe': use true or false."),
    ("train", "tags=dev", "tags='dev': use a list, e.g. [a,b]."),
    ("train", "extras.print_config=sometimes", "extras.print_config='sometimes': use true or false."),
    ("predict", "ckpt_path=a.ckpt kv_cache=maybe", "kv_cache='maybe': use true or false."),
    ("predict", "ckpt_path=a.ckpt max_new_tokens=many", "max_new_tokens='many': use a whole number."),
    ("export", "ckpt_path=a.ckpt tolerance=close", "tolerance='close': use a number."),
    ("serve", "ckpt_path=a.ckpt port=http", "port='http': use a whole number."),
    ("serve", "ckpt_path=a.ckpt limits.image_pixels=many", "limits.image_pixels='many': use a whole number."),
    ("bench", "bench.steps=many", "bench.steps='many': use a whole number."),
    ("bench", "bench.generation=maybe", "bench.generation='maybe': use true or false."),
{%- if cookiecutter.examples != "vision" %}
    ("prepare", "workers=abc", "workers='abc': use a whole number, or null."),
    ("prepare", "val_fraction=abc", "val_fraction='abc': use a number."),
    ("prepare", "vocab_size=300.5", "vocab_size=300.5: use a whole number."),
{%- endif %}
]  # fmt: skip


@pytest.mark.parametrize(("command", "setting", "line"), MISTYPED)
def test_a_setting_of_the_wrong_type_is_refused_while_composing_in_one_line(
    command: str, setting: str, line: str, tmp_path: Path
) -> None:
    with pytest.raises(HydraException) as refused:
        compose_config(command, setting.split(), tmp_path)
    assert one_line(refused.value) == line


def test_a_config_file_that_sets_no_setting_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """A misspelt key in an experiment (or configs/local/) was once added silently, and the
    setting it meant kept its default."""
    experiments = tmp_path / "mine" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "typo.yaml").write_text("# @package _global_\nresum: false\n")
    result = run_cli(
        "-m", PACKAGE, "--config-dir", str(tmp_path / "mine"), "experiment=typo", cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "error: resum, set in experiment/typo.yaml, is not a setting of this command: check the "
        "spelling (--cfg job prints every key; configs/schema.py lists the settings)."
    ]
    assert not (tmp_path / "logs").exists()


def test_a_mistyped_setting_on_the_command_line_is_one_line_and_writes_nothing(
    tmp_path: Path,
) -> None:
    probe = (
        "import sys\n"
        f"sys.argv = ['{PACKAGE}-train', 'seed=1.5']\n"
        f"from {PACKAGE}.cli import train\n"
        "try:\n    train()\nexcept SystemExit as ended:\n    print('EXIT', ended.code)\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED')\n"
    )
    result = run_cli("-c", probe, cwd=tmp_path, fresh=True)
    assert result.stderr.strip() == "error: seed=1.5: use a whole number, or null."
    assert "EXIT 1" in result.stdout and "TORCH_NOT_IMPORTED" in result.stdout
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("strategy", "kind", "shards", "model_parallel"),
    [
        ("auto", "auto", False, False),
        ("ddp", "ddp", False, False),
        ("ddp_spawn", "ddp_spawn", False, False),
        ("fsdp", "fsdp", True, False),
        ("model_parallel", "model_parallel", True, True),
    ],
)
def test_the_plan_names_the_strategy_and_whether_it_shards(
    strategy: str, kind: str, shards: bool, model_parallel: bool, tmp_path: Path
) -> None:
    """As its config builds it, and as the name Lightning takes."""
    node = compose_config("train", [f"strategy={strategy}"], tmp_path).trainer.strategy
    for given in (node, strategy):
        assert strategy_of(given) == strategy_of(node)
        assert (strategy_of(given).kind, strategy_of(given).shards) == (kind, shards)
        assert strategy_of(given).model_parallel == model_parallel


def test_the_validation_phase_returns_the_run_plan(tmp_path: Path) -> None:
    cfg = compose_config(
        "train", ["trainer=cpu", "seed=7", "resume=false", "ckpt_path='~/a.ckpt'"], tmp_path
    )
    plan = check_config(cfg)
    assert isinstance(plan, RunPlan)
    assert (plan.machine.accelerator, plan.machine.precision) == ("cpu", "32-true")
    assert plan.strategy == strategy_of("auto") and not plan.strategy.shards
    assert plan.run_dir == plan.start.run_dir == Path(cfg.paths.output_dir)
    assert plan.start.checkpoints == plan.run_dir / "checkpoints"
    assert plan.start.ckpt_path == Path.home() / "a.ckpt" and not plan.start.resume
    assert (plan.seed, plan.matmul_precision, plan.test) == (7, "high", True)
    # The default experiment's model applies FSDP2 itself only where it is the language model.
    assert plan.model_shards_itself is {{ "True" if cookiecutter.examples == "language" else "False" }}


# Modules that may read the composed config: the console scripts compose it, the recipes run
# it, and the validation phase checks it and makes the plan (targets.allow, the gate, takes
# `allowed_targets`; the sweep summary checks a multirun's settings before its jobs run).
READ_THE_CONFIG = {
    "cli.py", "run/settings.py", "run/schedule.py", "run/checks.py", "targets.py",
    "sweeps/summary.py",
}  # fmt: skip
# Hydra's own function that saves the config, wrapped under its own signature; it reads no key.
PASSES_THE_CONFIG_ON = {"run/record.py"}


def raw_config_readers(path: Path) -> list[str]:
    """Where `path` takes a parameter named `cfg` or reads `cfg.<key>`: the composed config, by
    this project's convention; the free-form nodes it hands to `build` go by their own names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            found += [f"{node.name}({a.arg})" for a in arguments if a.arg == "cfg"]
        elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "cfg":
            found.append(f"line {node.lineno}: cfg.{node.attr}")
    return found


def test_only_the_recipes_and_the_validation_phase_read_the_raw_config() -> None:
    readers = {}
    for path in sorted(SOURCE.rglob("*.py")):
        name = path.relative_to(SOURCE).as_posix()
        if name.startswith("recipes/") or name in READ_THE_CONFIG | PASSES_THE_CONFIG_ON:
            continue
        found = raw_config_readers(path)
        if found:
            readers[name] = found
    assert readers == {}
    assert raw_config_readers(SOURCE / "run" / "checks.py"), "the reader finds them"


# The groups users configure with `_target_`s, which go to `targets.build` as they are.
FREE_FORM = ("data", "model", "trainer", "callbacks", "logger")


def followed(value: Any, cfg: DictConfig) -> bool:
    """The config, the plan, or a node of the config's own settings (not of a free-form group)."""
    if value is cfg or isinstance(value, RunPlan):
        return True
    if not isinstance(value, (DictConfig, ListConfig)) or value._get_root() is not cfg:
        return False
    groups = {id(cfg._get_node(key)) for key in FREE_FORM if key in cfg}
    node: Any = value
    while node is not None and node is not cfg:
        if id(node) in groups:
            return False
        node = node._get_parent()
    return True


def rooms_of_a_run(cfg: DictConfig) -> tuple[list[tuple[str, int]], Counter[str]]:
    """(module, stack depth) of each call of the package that receives the config, one of its
    nodes or the plan, in order; and how often each of the package's functions was entered."""
    calls: list[tuple[str, int]] = []
    entered: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_globals.get("__name__", "").startswith(f"{PACKAGE}."):
            return
        module = frame.f_globals["__name__"].removeprefix(f"{PACKAGE}.")
        entered[f"{module}.{frame.f_code.co_name}"] += 1
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(followed(frame.f_locals.get(name), cfg) for name in names):
            depth, back = 0, frame.f_back
            while back is not None:
                depth, back = depth + 1, back.f_back
            calls.append((module, depth))

    sys.setprofile(profile)
    try:
        train(cfg)
    finally:
        sys.setprofile(None)
    return calls, entered


@pytest.mark.slow
def test_the_config_of_a_training_run_stays_in_few_rooms(tmp_path: Path) -> None:
    """Followed from `recipes.train.train`: the modules (rooms) whose functions receive the
    config, a node of its own settings or the plan; a climb back up is a change of room to a
    shallower call. "Does this run shard" is decided once, by `run.plan.strategy_of`."""
    cfg = compose_config(
        "train",
        [
            "trainer=cpu", "logger=csv", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
            "trainer.limit_val_batches=1", "test=false", "callbacks=none",
        ],
        tmp_path,
    )  # fmt: skip
    calls, entered = rooms_of_a_run(cfg)
    stays = [
        room for index, (room, _) in enumerate(calls) if index == 0 or calls[index - 1][0] != room
    ]
    climbs = sum(
        1
        for (room, depth), (before, above) in zip(calls[1:], calls[:-1], strict=True)
        if room != before and depth < above
    )
    assert len(set(stays)) <= 10, Counter(room for room, _ in calls)
    assert climbs <= 8, stays
    assert entered["run.plan.strategy_of"] == 1
    assert entered["memory.plan.shards_itself"] <= 1
