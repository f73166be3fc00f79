"""The gate for configs: which classes and functions a config may name in `_target_`, and the one
function that builds objects from a config (`build`). Hydra imports and calls whatever a config
names, and a checkpoint's stored config is a config too, so every `_target_`, at any depth, must
be a name that the project's own config files use (or name in a comment, as an option), or one
that the user lists in `allowed_targets`, exactly. No prefix admits a whole module: `torch` alone
holds functions that compile and run source code.

Every command checks its whole config once, before anything is written (`check_targets`), and
`build` checks again exactly the object it instantiates: the config resolved into plain values,
in which no interpolation is left for instantiation to resolve differently. A config stored in a
checkpoint is data (`stored_config`): plain values, no interpolation, no resolver."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import ConfigError, TrainingError

CONFIG_DIR = Path(__file__).parent / "configs"
NAMED_TARGET = re.compile(r"_target_\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_.]*)")
# Classes that FSDP's activation checkpointing imports by name, as the configs offer them.
NAMED_CLASS = re.compile(r"activation_checkpointing\s*:\s*\[\s*([A-Za-z_][A-Za-z0-9_.]*)")


@functools.cache
def shipped_targets(config_dir: Path = CONFIG_DIR) -> frozenset[str]:
    """Every `_target_` written in the config files, values and comments alike."""
    return frozenset(
        name
        for path in sorted(config_dir.rglob("*.yaml"))
        for pattern in (NAMED_TARGET, NAMED_CLASS)
        for name in pattern.findall(path.read_text(encoding="utf-8"))
    )


class Allowed:
    """The names this command's user listed in `allowed_targets` (set once, as the command
    starts, by `allow`)."""

    names: frozenset[str] = frozenset()


def allow(cfg: Any) -> None:
    """Take the command's `allowed_targets` for every `build` that follows, and check its whole
    config: the validation phase's first step in every command."""
    Allowed.names = frozenset(str(name) for name in OmegaConf.select(cfg, "allowed_targets") or ())
    check_targets(cfg, Allowed.names)


def allowed(name: str, key: str) -> str:
    """`name`, a class or function that code imports by name (not through `_target_`), if the
    configs name it or the user listed it."""
    if name not in shipped_targets() | Allowed.names:
        raise ConfigError(
            f"{key}={name} is not allowed: it may name only what the project's configs name, "
            f"and the exact names listed in allowed_targets. If you trust that code, add it: "
            f"'allowed_targets=[{name}]'."
        )
    return name


PLAIN_VALUES = (str, int, float, bool, type(None))
OPENS = "$" + "{"  # what starts an interpolation


def interpolations_in(value: Any, where: str = "") -> Iterable[str]:
    """The keys under `value` (plain containers) whose key or text holds `${`, which OmegaConf,
    and so Hydra's instantiate, takes for an interpolation."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and OPENS in key:
                yield path
            yield from interpolations_in(item, path)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from interpolations_in(item, f"{where}[{index}]")
    elif isinstance(value, str) and OPENS in value:
        yield where or "the value"


def stored_config(value: Any, source: str) -> dict[str, Any]:
    """A config that a file holds (a checkpoint's run_config), as data: nested dicts with string
    keys, lists and plain values, holding no interpolation or resolver (train stores its
    configs resolved, so one there was put in by hand)."""

    def check(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, item in node.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{source} holds a key {key!r} at {where}: not a config.")
                check(item, f"{where}.{key}" if where else key)
        elif isinstance(node, list):
            for index, item in enumerate(node):
                check(item, f"{where}[{index}]")
        elif not isinstance(node, PLAIN_VALUES):
            raise ConfigError(
                f"{source} holds a {type(node).__name__} at {where}: a stored config holds plain "
                "values only."
            )
        elif node == "???":
            raise ConfigError(
                f"{source} holds a missing value (???) at {where}: train stores only runs whose "
                "every value is set, so it was not written by train."
            )

    if not isinstance(value, dict):
        raise ConfigError(f"{source} holds a {type(value).__name__}, not a config.")
    check(value, "")
    found = next(iter(interpolations_in(value)), None)
    if found is not None:
        raise ConfigError(
            f"{source} holds an interpolation or resolver (`{OPENS}`) at {found}: this project stores "
            "configs resolved, so it was not written by train. Pass a checkpoint that train wrote."
        )
    return value


def plain(node: Any, source: str = "the config", where: str = "") -> Any:
    """`node` as plain values, each interpolation resolved in the config it belongs to. A value
    that still holds `${` once resolved is refused: instantiation would make it an
    interpolation again, resolved in another config."""
    value = (
        OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
        if isinstance(node, (DictConfig, ListConfig))
        else node
    )
    found = next(iter(interpolations_in(value, where)), None)
    if found is not None:
        raise ConfigError(
            f"{found} in {source} holds `{OPENS}` once resolved (an escaped interpolation, or one "
            "that a resolver made), which building it would resolve again: write the value "
            "without it."
        )
    return value


def build(node: Any, source: str = "the config", where: str = "", **kwargs: Any) -> Any:
    """The object that `node` configures: its targets checked on exactly what is instantiated.
    The only call of Hydra's `instantiate` in the package (a test reads the source to make
    sure)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    value = plain(node, source, where)
    check_targets(value, Allowed.names, source, where)
    try:
        return instantiate(value, **kwargs)
    except (InstantiationException, TypeError, ValueError) as error:  # Hydra's own checks too
        raise one_line_error(error, where) from error


def one_line_error(error: Exception, where: str) -> Exception:
    """Hydra's error for a class that cannot be found or built, as one line naming the key; our
    own errors raised while building pass through as they are."""
    if isinstance(error, (ConfigError, TrainingError)):
        return error
    if isinstance(error.__cause__, (ConfigError, TrainingError)):
        return error.__cause__
    message = str(error).replace(", set env var HYDRA_FULL_ERROR=1 to see chained exception", "")
    what, _, key = message.partition("\nfull_key: ")
    key = ".".join(part for part in (where, key) if part)
    return ConfigError(
        f"{key or 'config'}: {' '.join(what.split())} Check that key's values and `_target_`."
    )


def named_targets(node: Any, where: str = "") -> Iterable[tuple[str, str]]:
    """(config key, `_target_` value) for every `_target_` under `node`, without resolving it."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "_target_":
                yield path, str(value)
            else:
                yield from named_targets(value, path)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from named_targets(value, f"{where}[{index}]")


MAX_INTERPOLATION_DEPTH = 32


def interpolated_targets(
    node: DictConfig | ListConfig, where: str = "", depth: int = 0
) -> Iterable[tuple[str, str]]:
    """The `_target_`s that interpolations under `node` produce once resolved: a resolver such as
    `oc.create` or `oc.decode`, or a reference to a node outside `node` (`${hydra:...}`), can
    build a `_target_` that no config spells out, and instantiation resolves them all."""
    if depth > MAX_INTERPOLATION_DEPTH:
        raise ConfigError(
            f"{where or 'the config'} nests interpolations more than {MAX_INTERPOLATION_DEPTH} "
            "deep: untangle the interpolations that refer to each other."
        )
    container: Any = node  # keys of either kind, indexed alike
    if isinstance(node, DictConfig):
        children = [(key, f"{where}.{key}" if where else str(key)) for key in container]
    else:
        children = [(index, f"{where}[{index}]") for index in range(len(node))]
    for key, path in children:
        child = container._get_node(key)  # the node itself, not its resolved value
        if OmegaConf.is_interpolation(container, key):
            try:
                value = container[key]
            except Exception:  # unresolvable here, so it cannot build anything either
                continue
            if isinstance(value, (dict, list)):
                value = OmegaConf.create(value)
            if isinstance(value, (DictConfig, ListConfig)):
                yield from named_targets(value, path)
                yield from interpolated_targets(value, path, depth + 1)
        elif isinstance(child, (DictConfig, ListConfig)):
            yield from interpolated_targets(child, path, depth)


def check_targets(
    node: Any, extra_allowed: Iterable[str] = (), source: str = "the config", where: str = ""
) -> None:
    allowed = shipped_targets() | {str(name) for name in extra_allowed}
    if not isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.create(node)  # as `instantiate` sees it: interpolations become live
    for key, target in (*named_targets(node, where), *interpolated_targets(node, where)):
        if target not in allowed:
            raise ConfigError(
                f"{key}={target} in {source} is not allowed: `_target_` may name only what the "
                "project's configs name, and the exact names listed in allowed_targets. If you "
                f"trust that code, add it: 'allowed_targets=[{target}]'."
            )


def check_hydra_callbacks() -> None:
    """Hydra builds the callbacks under `hydra.callbacks` before a run starts, and before the
    recipes check anything: their `_target_`s pass the same check first, in every command."""
    from hydra._internal.callbacks import Callbacks

    build = Callbacks.__init__
    if getattr(build, "checks_targets", False):
        return

    def checked(self: Callbacks, config: DictConfig | None = None) -> None:
        if config is not None and OmegaConf.select(config, "hydra.callbacks"):
            allowed = OmegaConf.select(config, "allowed_targets") or ()
            check_targets(config.hydra.callbacks, allowed, where="hydra.callbacks")
        build(self, config)

    checked.checks_targets = True  # type: ignore[attr-defined]
    Callbacks.__init__ = checked  # type: ignore[method-assign]


# What Python's logging config may build (`class` of a handler, `()` of any entry) without listing.
LOGGING_CLASSES = frozenset({
    "logging.Filter", "logging.Formatter", "logging.FileHandler", "logging.NullHandler",
    "logging.StreamHandler", "logging.handlers.RotatingFileHandler",
    "logging.handlers.TimedRotatingFileHandler", "logging.handlers.WatchedFileHandler",
    "colorlog.ColoredFormatter",
})  # fmt: skip


def logging_factories(config: Any) -> Iterable[tuple[str, str]]:
    """(config key, name) of every callable that `hydra.hydra_logging` and `hydra.job_logging`
    name for Python's `logging.config.dictConfig`, which imports and calls them."""
    for part in ("hydra_logging", "job_logging"):
        node = OmegaConf.select(config, f"hydra.{part}")
        plain = OmegaConf.to_container(node, resolve=False) if node is not None else None
        if not isinstance(plain, dict):
            continue
        for section in ("formatters", "filters", "handlers"):
            entries = plain.get(section)
            for name, entry in (entries if isinstance(entries, dict) else {}).items():
                for key in ("()", "class"):
                    if isinstance(entry, dict) and key in entry:
                        named = str(entry[key]).removeprefix("ext://")
                        yield f"hydra.{part}.{section}.{name}.{key}", named


RUN_FOLDER = ("$" + "{hydra.runtime.output_dir}/", "$" + "{hydra:runtime.output_dir}/")


def under_the_run(name: str, root: Any) -> bool:
    """`name`, its interpolations resolved in the config (`${task_name}.log`), names a file
    inside the folder it is put in."""
    try:
        resolved = str(OmegaConf.create({"name": name}, parent=root).name)
    except Exception:
        return False
    path = Path(resolved)
    return bool(resolved) and not path.is_absolute() and ".." not in path.parts


def check_log_files(root: Any) -> None:
    """A logging handler writes only inside the run's folder: `filename` (and its `mode`) could
    otherwise overwrite any file the user can write. Checked as written, before Hydra makes the
    folder: a job's log file is `${hydra.runtime.output_dir}/<name>`, and Hydra's own logging,
    set up before the run has a folder, writes no file."""
    for part in ("hydra_logging", "job_logging"):
        handlers = OmegaConf.select(root, f"hydra.{part}.handlers")
        plain = OmegaConf.to_container(handlers, resolve=False) if handlers is not None else None
        for name, entry in (plain if isinstance(plain, dict) else {}).items():
            if not isinstance(entry, dict) or entry.get("filename") is None:
                continue
            written = str(entry["filename"])
            rest = next((written[len(p) :] for p in RUN_FOLDER if written.startswith(p)), None)
            inside = part == "job_logging" and rest is not None and under_the_run(rest, root)
            if not inside:
                raise ConfigError(
                    f"hydra.{part}.handlers.{name!s}.filename={written}: logging writes files only "
                    f"in the run's folder, as hydra.job_logging.handlers.<name>.filename="
                    f"{RUN_FOLDER[0]}<file name>."
                )


def check_logging_configs() -> None:
    """Hydra configures logging as it composes the config, before any command checks anything:
    the callables that the logging configs name pass a check first (Hydra's own policy refuses
    the worst of them, but with a traceback and after making the run directory)."""
    import hydra._internal.hydra as hydra_app

    configure = hydra_app.configure_log
    if getattr(configure, "checks_targets", False):
        return

    def checked(log_config: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(log_config, DictConfig):
            root = log_config._get_root()
            allowed = LOGGING_CLASSES | {
                str(name) for name in OmegaConf.select(root, "allowed_targets") or ()
            }
            for key, name in logging_factories(root):
                if name not in allowed:
                    raise ConfigError(
                        f"{key}={name} in the config is not allowed: a logging config may name "
                        "logging's own handlers, formatters and filters, and the exact names "
                        f"listed in allowed_targets. If you trust that code, add it: "
                        f"'allowed_targets=[{name}]'."
                    )
            check_log_files(root)
        configure(log_config, *args, **kwargs)

    checked.checks_targets = True  # type: ignore[attr-defined]
    hydra_app.configure_log = checked
