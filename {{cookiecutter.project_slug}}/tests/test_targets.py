"""Nothing runs that the user did not write: a `_target_`, in a config or in a checkpoint's stored
config, at any depth, must be a name the project's configs use or one listed exactly in
`allowed_targets`. Each dangerous callable below, given arguments that would leave a file behind
if it ran, is refused by train and by eval before anything is imported."""

from __future__ import annotations

import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
)
from {{ cookiecutter.package_name }}.recipes.evaluate import (
    evaluate,
)
from {{ cookiecutter.package_name }}.recipes.train import (
    train,
)
from {{ cookiecutter.package_name }}.targets import (
    check_targets,
    shipped_targets,
)

from .helpers import PACKAGE, ComposeFn, run_cli


def dangerous_calls(marker: Path) -> dict[str, list[Any]]:
    """Callables that run or compile code, load pickles, extensions or hub code, or touch the
    system; with arguments that would create `marker` where the callable can."""
    python = f"open({str(marker)!r}, 'w').close()"
    return {
        "builtins.eval": [python],
        "builtins.exec": [python],
        "builtins.compile": [python, "x", "exec"],
        "builtins.__import__": ["os"],
        "builtins.open": [str(marker), "w"],
        "os.system": [f"touch {marker}"],
        "os.popen": [f"touch {marker}"],
        "subprocess.run": [["touch", str(marker)]],
        "subprocess.Popen": [["touch", str(marker)]],
        "subprocess.check_output": [["touch", str(marker)]],
        "importlib.import_module": ["os"],
        "runpy.run_path": [str(marker)],
        "pickle.loads": [f"cos\nsystem\n(S'touch {marker}'\ntR."],
        "shutil.rmtree": [str(marker.parent / "nothing")],
        "ctypes.CDLL": ["libc.so.6"],
        "hydra.utils.get_method": ["os.system"],
        "hydra.utils.call": [{"_target_": "os.system", "_args_": [f"touch {marker}"]}],
        "hydra.utils.instantiate": [{"_target_": "os.system", "_args_": [f"touch {marker}"]}],
        "torch.load": [str(marker)],
        "torch.hub.load": ["someone/repo", "model"],
        "torch.utils.cpp_extension.load_inline": ["ext", python],
        "torch.jit.CompilationUnit": ["def f(x: int) -> int:\n    return x\n"],
        "torch.fx.graph_module._forward_from_src": [python, {}],
        "torch.package.PackageImporter": [str(marker)],
        # Prefix look-alikes: the project's own package name, then more.
        f"{PACKAGE}_evil.run": [python],
        f"{PACKAGE}.recipes.train.os.system": [f"touch {marker}"],
    }


CALLABLES = list(dangerous_calls(Path("marker")))


def with_target(cfg: DictConfig, key: str, target: str, args: list[Any]) -> DictConfig:
    with open_dict(cfg):
        OmegaConf.update(cfg, key, {"_target_": target, "_args_": args}, force_add=True)
    return cfg


@pytest.mark.parametrize("target", CALLABLES)
def test_train_refuses_a_dangerous_target_and_runs_nothing(
    train_config: ComposeFn, tmp_path: Path, target: str
) -> None:
    marker = tmp_path / "ran"
    cfg = with_target(train_config(), "model.net", target, dangerous_calls(marker)[target])
    refused = re.escape(f"model.net._target_={target} in the config is not")
    with pytest.raises(ConfigError, match=refused):
        train(cfg)
    assert not marker.exists()
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists(), "nothing was trained"


@pytest.mark.parametrize("target", CALLABLES)
def test_eval_refuses_a_checkpoint_naming_a_dangerous_target_and_runs_nothing(
    train_config: ComposeFn, eval_config: ComposeFn, tmp_path: Path, target: str
) -> None:
    """The checkpoint loads with weights_only=True; its stored config is what would run."""
    marker = tmp_path / "ran"
    trained = train_config()
    model = OmegaConf.to_container(trained.model, resolve=True)
    assert isinstance(model, dict)
    # Deep: inside the optimizer's positional arguments.
    model["optimizer"]["_args_"] = [{"_target_": target, "_args_": dangerous_calls(marker)[target]}]
    data = OmegaConf.to_container(trained.data, resolve=True)
    checkpoint = tmp_path / "hostile.ckpt"
    run_config = {"data": data, "model": model}
    torch.save(dict(run_config=run_config, state_dict={}), checkpoint)
    refused = re.escape(f"model.optimizer._args_[0]._target_={target} in")
    with pytest.raises(ConfigError, match=refused):
        evaluate(eval_config(f"ckpt_path='{checkpoint}'"))
    assert not marker.exists()


def test_every_shipped_target_is_an_exact_name_and_none_is_a_module_prefix() -> None:
    names = shipped_targets()
    assert f"{PACKAGE}.recipes.train.train" not in names
    assert "torch" not in names and "lightning" not in names
    assert "torch.optim.AdamW" in names and "datetime.timedelta" in names


def test_a_listed_name_is_allowed_exactly_and_no_prefix_of_it() -> None:
    optimizer = {"_target_": "torch.optim.SGD"}
    node = {"model": dict(optimizer=optimizer)}
    with pytest.raises(ConfigError, match=re.escape("allowed_targets=[torch.optim.SGD]")):
        check_targets(node)
    check_targets(node, ["torch.optim.SGD"])
    for prefix in ("torch", "torch.optim", "torch.optim."):
        with pytest.raises(ConfigError):
            check_targets(node, [prefix])
    with pytest.raises(ConfigError):
        check_targets(dict(x={"_target_": "torch.load"}), ["torch"])


def test_a_target_hidden_in_an_interpolation_is_refused() -> None:
    model = {"_target_": "${name}"}
    node = OmegaConf.create({"name": "os.system", "model": model})
    with pytest.raises(ConfigError, match=re.escape("${name}")):
        check_targets(node)


def resolved(resolver: str, argument: str) -> str:
    return "${" + f"{resolver}:{argument}" + "}"


def hidden_targets(marker: Path) -> dict[str, Any]:
    """Values with no `_target_` written in them that build one when resolved."""
    target = "'{_target_: builtins.open, _args_: [" + str(marker) + ", w]}'"
    return {
        "oc.create": resolved("oc.create", target),
        "oc.decode": resolved("oc.decode", target),
        "in a list": [1, resolved("oc.create", target)],
        "a resolver inside a resolver": resolved("oc.create", resolved("oc.decode", target)),
    }


@pytest.mark.parametrize("form", list(hidden_targets(Path("marker"))))
def test_a_target_built_by_a_resolver_is_refused(
    train_config: ComposeFn, tmp_path: Path, form: str
) -> None:
    marker = tmp_path / "ran"
    cfg = train_config()
    with open_dict(cfg):
        OmegaConf.update(cfg, "callbacks.hidden", hidden_targets(marker)[form], force_add=True)
    with pytest.raises(ConfigError, match=re.escape("=builtins.open in the config is not")):
        train(cfg)
    assert not marker.exists()
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists(), "nothing was trained"


def test_eval_refuses_a_checkpoint_whose_config_builds_a_target_when_resolved(
    train_config: ComposeFn, eval_config: ComposeFn, tmp_path: Path
) -> None:
    """A stored config is data: an interpolation or resolver in it is refused before anything
    resolves it."""
    marker = tmp_path / "ran"
    trained = train_config()
    model = OmegaConf.to_container(trained.model, resolve=True)
    assert isinstance(model, dict)
    model["optimizer"]["_args_"] = [hidden_targets(marker)["oc.create"]]
    data = OmegaConf.to_container(trained.data, resolve=True)
    checkpoint = tmp_path / "hostile.ckpt"
    torch.save(dict(run_config={"data": data, "model": model}, state_dict={}), checkpoint)
    refused = re.escape("holds an interpolation or resolver (`$" + "{`) at optimizer._args_[0]")
    with pytest.raises(ConfigError, match=refused):
        evaluate(eval_config(f"ckpt_path='{checkpoint}'"))
    assert not marker.exists()


def two_roots(trained: DictConfig, marker: Path) -> dict[str, Any]:
    """The tester's stored config: an escaped interpolation that names a harmless network when
    resolved from the wrapper `{data, model}` and a call of `builtins.open` when resolved from
    the model config (where `instantiate` resolved it)."""
    model = OmegaConf.to_container(trained.model, resolve=True)
    data = OmegaConf.to_container(trained.data, resolve=True)
    assert isinstance(model, dict)
    model["s"] = {"_target_": "builtins.open", "file": str(marker), "mode": "w"}
    model["net"] = "\\$" + "{model.s}"
    model["model"] = {"s": model["net"]}
    return {"data": data, "model": model}


COMMANDS = {
    "train": ["-m", PACKAGE],
    "eval": ["-c", f"from {PACKAGE}.cli import evaluate; evaluate()"],
    "predict": ["-c", f"from {PACKAGE}.cli import predict; predict()"],
    "export": ["-c", f"from {PACKAGE}.cli import export; export()"],
{%- if cookiecutter.examples != "vision" %}
    "prepare": ["-c", f"from {PACKAGE}.cli import prepare; prepare()"],
{%- endif %}
    "bench": ["-c", f"from {PACKAGE}.recipes.bench import main; main()"],
    "doctor": ["-c", f"import sys; from {PACKAGE}.recipes.doctor import main; sys.exit(main())"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_a_hostile_target_and_runs_nothing(
    tmp_path: Path, command: str
) -> None:
    """The same gate in every console script: a `_target_` override that would create a file."""
    marker = tmp_path / "ran"
    hostile = "+model.evil={_target_:builtins.open,file:" + str(marker) + ",mode:w}"
    ckpt = [] if command in ("train", "bench", "doctor", "prepare") else ["ckpt_path=missing.ckpt"]
    machine = [] if command in ("export", "prepare") else ["trainer=cpu"]
    result = run_cli(*COMMANDS[command], *machine, *ckpt, hostile, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:] + result.stdout
    assert "model.evil._target_=builtins.open in the config is not allowed" in errors[0]
    assert not marker.exists(), f"{command} ran the target"


@pytest.mark.parametrize("command", ["eval", "predict", "export"])
def test_a_stored_config_that_would_resolve_against_another_root_runs_nothing(
    train_config: ComposeFn, tmp_path: Path, command: str
) -> None:
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "hostile.ckpt"
    run_config = two_roots(train_config(), marker)
    torch.save(dict(run_config=run_config, state_dict={}), checkpoint)
    args = [f"ckpt_path={checkpoint}"] + ([] if command == "export" else ["trainer=cpu"])
    result = run_cli(*COMMANDS[command], *args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert "holds an interpolation or resolver" in lines[0] and "at net:" in lines[0], lines[0]
    assert not marker.exists(), f"{command} ran the stored target"


def test_a_target_reached_through_hydras_own_config_is_refused(tmp_path: Path) -> None:
    """The run's config can point into Hydra's (`${hydra:...}`), which it does not contain, and
    a Hydra callback can be built by a resolver."""
    made = tmp_path / "made"
    target = '"{_target_: pathlib.Path.mkdir, self: ' + str(made) + '}"'
    attacks = {
        "callbacks.x": [
            "+hydra.job_logging.stash._target_=pathlib.Path.mkdir",
            f"+hydra.job_logging.stash.self={made}",
            "+callbacks.x='${hydra:job_logging.stash}'",
        ],
        "hydra.callbacks.x": ["+hydra.callbacks.x='" + resolved("oc.create", target) + "'"],
    }
    for key, overrides in attacks.items():
        result = run_cli("-m", PACKAGE, "trainer=cpu", "debug=fdr", *overrides, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
        assert f"{key}._target_=pathlib.Path.mkdir in the config is not" in lines[0]
        assert not made.exists() and not (tmp_path / "logs").exists()


def test_a_hydra_callback_is_checked_before_hydra_builds_it(tmp_path: Path) -> None:
    """Hydra builds `hydra.callbacks` before any recipe runs; a file-writing callable there could
    plant code (a .pth file) for the next Python start."""
    made = tmp_path / "made"
    callback = ["+hydra.callbacks.x._target_=pathlib.Path.mkdir", f"+hydra.callbacks.x.self={made}"]
    for sweep in ([], ["-m", "seed=1,2"]):
        result = run_cli("-m", PACKAGE, *sweep, "trainer=cpu", "debug=fdr", *callback, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
        assert "hydra.callbacks.x._target_=pathlib.Path.mkdir in the config is not" in lines[0]
        assert not made.exists() and not (tmp_path / "logs").exists()
    # Listed exactly, it is built (the run then stops at its bad seed).
    listed = run_cli(
        "-m", PACKAGE, "seed=-1", *callback, "allowed_targets=[pathlib.Path.mkdir]", cwd=tmp_path
    )
    assert listed.returncode == 1 and "seed" in listed.stderr and made.is_dir()


def test_a_logging_config_naming_other_code_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    """Python's logging config imports and calls a handler's `class` and any entry's `()`;
    Hydra applies it as it composes the config, before any command checks anything."""
    made = tmp_path / "made.zip"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "factory.yaml").write_text(
        "defaults:\n  - train\n  - _self_\nhydra:\n  hydra_logging:\n    formatters:\n"
        f"      x:\n        (): zipfile.ZipFile\n        file: {made}\n        mode: w\n"
    )
    handler = ["+hydra.job_logging.handlers.x.class=zipfile.ZipFile",
               f"+hydra.job_logging.handlers.x.file={made}", "+hydra.job_logging.handlers.x.mode=w"]  # fmt: skip
    attacks = {
        "hydra.hydra_logging.formatters.x.()": ["--config-dir", "configs", "--config-name", "factory"],
        "hydra.job_logging.handlers.x.class": handler,
    }  # fmt: skip
    for key, overrides in attacks.items():
        result = run_cli("-m", PACKAGE, "trainer=cpu", "debug=fdr", *overrides, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
        assert f"{key}=zipfile.ZipFile in the config is not allowed" in lines[0]
        assert not made.exists() and not (tmp_path / "logs").exists()
    # Listed exactly, it is built (and Hydra's logging set-up then fails on what it returns).
    run_cli("-m", PACKAGE, "seed=-1", *handler, "allowed_targets=[zipfile.ZipFile]", cwd=tmp_path)
    assert made.is_file()


RUN_FOLDER = "$" + "{hydra.runtime.output_dir}"
LOG_FILE = "hydra.job_logging.handlers.file.filename="
LOG_FILES = {
    "absolute": [LOG_FILE + "VICTIM"],
    "up and out": [LOG_FILE + RUN_FOLDER + "/../../../victim.txt"],
    "through the task name": ["task_name=../../../../victim"],
    "an environment variable": [LOG_FILE + RUN_FOLDER + "/$" + "{oc.env:LOG_TARGET}"],
    "hydra's own logging": ["+hydra.hydra_logging.handlers.x.class=logging.FileHandler",
                            "+hydra.hydra_logging.handlers.x.filename=VICTIM"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(LOG_FILES))
def test_a_log_file_is_written_only_inside_the_run_folder(tmp_path: Path, case: str) -> None:
    """An allowed FileHandler with any file name (and `mode: w`) would overwrite any file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("kept\n")
    overrides = [override.replace("VICTIM", str(victim)) for override in LOG_FILES[case]]
    result = run_cli(
        "-m", PACKAGE, "trainer=cpu", "debug=fdr", "logger=csv", *overrides,
        "+hydra.job_logging.handlers.file.mode=w", cwd=tmp_path, env={"LOG_TARGET": str(victim)},
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    assert "logging writes files only in the run's folder" in lines[0], lines[0]
    assert victim.read_text() == "kept\n" and not (tmp_path / "logs").exists()


class CountingServer(http.server.BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        CountingServer.requests.append(self.path)
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def local_server() -> Iterator[str]:
    """An HTTP server on the loopback address that records every request it gets."""
    CountingServer.requests.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CountingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/x"
    finally:
        server.shutdown()


STORED_DATA = {
{%- if cookiecutter.examples != "language" %}
    "_target_": f"{PACKAGE}.data.mnist.MNISTDataModule",
    "download": True,
{%- else %}
    "_target_": f"{PACKAGE}.data.token_shards.TokenShardDataModule",
{%- endif %}
}
LOCATION = "{{ 'data_dir' if cookiecutter.examples != 'language' else 'path' }}"


def test_a_checkpoints_data_location_is_followed_only_to_a_local_path(
    train_config: ComposeFn, eval_config: ComposeFn, tmp_path: Path, local_server: str
) -> None:
    """A stored data location that is a URL, or a path that is not there, is never followed
    (no request leaves); the user names the data on the command line instead."""
    model = OmegaConf.to_container(train_config().model, resolve=True)
    for location, refused in ((local_server, "a URL"), (str(tmp_path / "gone"), "does not exist")):
        checkpoint = tmp_path / "stored.ckpt"
        data = {**STORED_DATA, LOCATION: location}
        torch.save(dict(run_config={"data": data, "model": model}, state_dict={}), checkpoint)
        with pytest.raises(
            ConfigError, match=f"stores data.{LOCATION}=.*{refused}.*data.{LOCATION}="
        ) as error:
            evaluate(eval_config(f"ckpt_path='{checkpoint}'"))
        assert "\n" not in str(error.value)
    assert CountingServer.requests == []
    given = eval_config(f"ckpt_path='{checkpoint}'", f"+data.{LOCATION}={tmp_path}")
    with pytest.raises(Exception) as error:  # whatever the empty folder gives
        evaluate(given)
    assert "stores data." not in str(error.value), "the user's location is used"
    assert CountingServer.requests == []
