"""Every config of every group composes; the instantiable ones instantiate (models on the meta
device: their shapes and parameter counts, without filling memory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.run.settings import (
    SWITCHES,
)

from .helpers import CONFIG_DIR, PACKAGE, PROJECT_ROOT, ComposeFn, run_cli

GROUPS = ["data", "model", "scheduler", "trainer", "callbacks", "logger", "debug", "experiment"]
OPTIONS = [
    (group, path.stem) for group in GROUPS for path in sorted((CONFIG_DIR / group).glob("*.yaml"))
]


@pytest.mark.parametrize(
    "group",
    ["data", "model", "scheduler", "trainer", "strategy", "hparams_search", "logger", "experiment"],
)
def test_the_docs_config_tree_lists_every_option(group: str) -> None:
    page = (PROJECT_ROOT / "docs" / "configs.md").read_text()
    (row,) = [line for line in page.splitlines() if line.startswith(f"| `{group}/` |")]
    listed = set(re.findall(r"`([^`/]+)`", row.split("|")[3]))
    assert listed == {path.stem for path in (CONFIG_DIR / group).glob("*.yaml")}


def experiment_using(group: str, option: str) -> list[str]:
    """The experiment that selects this option, if any: models and data sets that depend on each
    other (a model that reads a size from its data config) compose inside their experiment."""
    for path in sorted((CONFIG_DIR / "experiment").glob("*.yaml")):
        if f"override /{group}: {option}" in path.read_text():
            return [f"experiment={path.stem}"]
    return []


def test_every_group_has_options() -> None:
    groups = {group for group, _ in OPTIONS}
    assert groups == set(GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_resolves(train_config: ComposeFn, group: str, option: str) -> None:
    cfg = train_config(*experiment_using(group, option), f"{group}={option}")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    assert resolved["trainer"]["_target_"] == "lightning.pytorch.Trainer"


def bool_keys(node: object, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in bool_keys(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if isinstance(node, bool) else []


def matches(key: str, pattern: str) -> bool:
    group, wildcard, leaf = pattern.partition(".*.")
    if not wildcard:
        return key == pattern
    head, _, rest = key.removeprefix(f"{group}.").partition(".")
    return key.startswith(f"{group}.") and bool(head) and rest == leaf


STRATEGIES = sorted(path.stem for path in (CONFIG_DIR / "strategy").glob("*.yaml"))


CONFIGURATIONS = {
    **{f"{g}={o}": [f"{g}={o}", *experiment_using(g, o)] for g, o in OPTIONS},
    **{f"strategy={s}": [f"strategy={s}"] for s in STRATEGIES},
}


@pytest.mark.parametrize("overrides", list(CONFIGURATIONS.values()), ids=list(CONFIGURATIONS))
def test_every_switch_in_a_config_is_checked(train_config: ComposeFn, overrides: list[str]) -> None:
    """A true/false setting given a word (`fused=abc`) is refused in one line, not taken as true:
    every key that a config sets to true or false is one that the run's check reads."""
    resolved = OmegaConf.to_container(train_config(*overrides), resolve=True)
    found = [
        key
        for key in bool_keys(resolved)
        if not key.startswith("hydra.")
        and not key.rpartition(".")[2].startswith("_")  # Hydra's own (_partial_), which it checks
        and key != "trainer.fast_dev_run"  # true, false or a number of batches: checked as such
    ]
    unchecked = [key for key in found if not any(matches(key, p) for p in SWITCHES)]
    assert unchecked == []


# Data configs that read the user's own files (written by prepare, or a folder of images): with
# none there, building them is one error saying what to do.
NEEDS_FILES = {"token_shards", "image_folder", "tokenized_text"}


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONFIG_DIR / "data").glob("*.yaml")))
def test_data_instantiates(train_config: ComposeFn, option: str, tmp_path: Path) -> None:
    data = train_config(f"data={option}", f"paths.data_dir={tmp_path}").data
    if option in NEEDS_FILES:
        with pytest.raises(Exception) as raised:
            instantiate(data)
        assert type(raised.value.__cause__).__name__ == "ConfigError", raised.value
        return
    datamodule = instantiate(data)
    assert hasattr(datamodule, "train_dataloader")
{%- if cookiecutter.examples != "vision" %}


PARAMETERS_THE_README_STATES = {"gpt2_medium": "303M", "gpt_1b": "1211M"}
{%- else %}


PARAMETERS_THE_README_STATES: dict[str, str] = {}
{%- endif %}


# Models built from the user's own files (a pretrained backbone's folder): with none there,
# building them is one error saying what to do.
MODELS_NEEDING_FILES = {"backbone_classifier"}


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml")))
def test_model_instantiates(train_config: ComposeFn, option: str) -> None:
    with torch.device("meta"):  # shapes only: the larger configs would fill gigabytes
        cfg = train_config(*experiment_using("model", option), f"model={option}")
        if option in MODELS_NEEDING_FILES:
            with pytest.raises(Exception) as raised:
                instantiate(cfg.model)
            assert type(raised.value.__cause__).__name__ == "ConfigError", raised.value
            return
        model = instantiate(cfg.model)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters > 0
    if option in PARAMETERS_THE_README_STATES:
        assert f"{parameters / 1e6:.0f}M" == PARAMETERS_THE_README_STATES[option]


def test_callbacks_and_loggers_instantiate(train_config: ComposeFn, tmp_path: Path) -> None:
    from {{ cookiecutter.package_name }}.loggers import (
        instantiate_callbacks,
        instantiate_group,
    )
{%- if cookiecutter.logger == "csv" %}

    cfg = train_config("logger=csv")
{%- else %}

    cfg = train_config("logger=[csv,{{ cookiecutter.logger }}]")
{%- endif %}
    callbacks = instantiate_callbacks(cfg.callbacks, have_logger=True)
    names = {type(c).__name__ for c in callbacks}
    assert {"RunCheckpoint", "EarlyStopping", "LearningRateMonitor", "Throughput"} <= names
    loggers = instantiate_group(cfg.logger, "logger")
    assert len(loggers) == {% if cookiecutter.logger == "csv" %}1{% else %}2{% endif %}


def test_eval_config_composes(eval_config: ComposeFn) -> None:
    cfg = eval_config("ckpt_path=some.ckpt")
    assert cfg.ckpt_path == "some.ckpt"
    OmegaConf.to_container(cfg, resolve=True)


def test_every_trainer_argument_is_a_config_key(train_config: ComposeFn) -> None:
    """`trainer.fast_dev_run=true` and the like work as the Trainer's own arguments, not as
    Hydra's "not in struct" error."""
    import inspect

    import lightning as L

    passed_by_the_recipe = {"self", "logger", "callbacks", "plugins"}
    newer_than_the_lowest_supported = {"enable_autolog_hparams", "model_registry"}
    arguments = set(inspect.signature(L.Trainer.__init__).parameters)
    expected = arguments - passed_by_the_recipe - newer_than_the_lowest_supported
    assert expected <= set(train_config().trainer)


def test_a_local_config_sets_keys_at_the_top_level(tmp_path: Path) -> None:
    """`configs/local/<name>.yaml` holds keys as written at the top level, without a header."""
    (tmp_path / "configs" / "local").mkdir(parents=True)
    (tmp_path / "configs" / "local" / "mine.yaml").write_text("trainer:\n  max_epochs: 1\n")
    local = ["--config-dir", "configs", "local@_global_=mine"]
    result = run_cli("-m", PACKAGE, *local, "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    config = OmegaConf.create(result.stdout)
    assert config.trainer.max_epochs == 1 and "local" not in config


def test_the_config_is_printed_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from {{ cookiecutter.package_name }}.cli import _run

    from .helpers import compose_config

    for asked, printed in ([], False), (["extras.print_config=true"], True):
        cfg = compose_config("train", ["trainer=cpu", "logger=csv", *asked], tmp_path)
        assert cfg.extras.print_config is printed
        _run(lambda cfg: {}, cfg)
        assert ("task_name: train" in capsys.readouterr().out) is printed
