"""The package's floor plan, read from its source (every import, those inside functions
included): the commands (`cli`, `recipes/`) on top; the plumbing beneath them, grouped by concern
(`run/`, `checkpointing/`, `memory/`, `sweeps/`, `callbacks/` and a few modules in the package
root), which never imports a recipe; `models/` and `data/`, which users edit, at the bottom,
importing nothing else of the project; and no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

from .helpers import PACKAGE, PROJECT_ROOT

SOURCE = PROJECT_ROOT / "src" / PACKAGE
BOTTOM = ("models", "data")
PLUMBING = ("run", "checkpointing", "memory", "sweeps", "callbacks")
# The package root: the console scripts and a handful of modules every layer shares.
ROOT_MODULES = {
    "cli", "command_errors", "console", "entry", "errors", "files", "loggers", "targets",
}  # fmt: skip
MOST_IN_ROOT = 8  # besides __init__, __main__ and cli


def module_of(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(path): path for path in SOURCE.rglob("*.py")}


def runs_as_script(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`, where a module run with `python -m` calls its command."""
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


def imported_by(module: str) -> set[str]:
    """The project's modules that `module` imports (a name taken from a package counts as its
    submodule where one has that name)."""
    path = MODULES[module]
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
    while pending:
        node = pending.pop()
        if runs_as_script(node):
            continue
        pending.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            targets = [
                alias.name.removeprefix(f"{PACKAGE}.")
                for alias in node.names
                if alias.name.startswith(f"{PACKAGE}.")
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1] if node.level > 1 else here
                source = ".".join([*base, *([node.module] if node.module else [])])
            elif (node.module or "").startswith(f"{PACKAGE}."):
                source = (node.module or "").removeprefix(f"{PACKAGE}.")
            else:
                continue
            targets = [
                f"{source}.{alias.name}".strip(".")
                if f"{source}.{alias.name}".strip(".") in MODULES
                else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


GRAPH = {module: imported_by(module) for module in MODULES}


def top(module: str) -> str:
    return module.split(".")[0]


def test_the_import_reader_sees_what_python_imports() -> None:
    preemption = GRAPH["callbacks.preemption"]
    assert {"callbacks.exact_resume", "checkpointing.saving", "run.stop_signals"} <= preemption
    assert "entry" in GRAPH["__main__"]
    assert "cli" in GRAPH["entry"], "an import inside a function counts"
    assert "recipes.train" in GRAPH["cli"]
    assert "cli" not in GRAPH["recipes.train"], "`python -m <package>.recipes.train`'s does not"


def test_the_package_root_holds_a_handful_of_modules_and_the_rest_is_grouped() -> None:
    in_root = {module for module, path in MODULES.items() if path.parent == SOURCE}
    assert in_root - {"", "__main__"} == ROOT_MODULES
    assert len(ROOT_MODULES - {"cli"}) <= MOST_IN_ROOT
    groups = {top(module) for module in MODULES} - in_root - {""}
    assert groups == {*BOTTOM, *PLUMBING, "recipes", "configs"}


def test_models_and_data_import_nothing_else_of_the_project() -> None:
    leaks = {
        module: sorted(target for target in targets if top(target) != top(module))
        for module, targets in GRAPH.items()
        if top(module) in BOTTOM
    }
    assert {module: found for module, found in leaks.items() if found} == {}


def recipe(module: str) -> str | None:
    """The command a module belongs to (`recipes.bench.training` -> `bench`), or None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "recipes" and len(parts) > 1 else None


def test_plumbing_never_imports_a_recipe_and_recipes_import_no_other_recipe() -> None:
    """Only the console scripts lead into a command: what two recipes need lives beneath both."""
    edges = sorted(
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if recipe(target) and recipe(target) != recipe(module) and module != "cli"
    )
    assert edges == []


def test_no_module_imports_itself_through_others() -> None:
    """No import circle: a depth-first walk from every module never comes back to one on its
    path."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(" -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(GRAPH[module]):
            walk(target, [*path, module])
        done.add(module)

    for module in sorted(GRAPH):
        walk(module, [])


# What reads untrusted bytes, or builds objects from a config, and the one module (or package) each
# may be in.
DOORS = {
    "checkpointing.door": {
        "pickle", "torch.load", "torch.export.load", "torch.distributed.checkpoint.load",
        "torch.distributed.checkpoint.FileSystemReader", "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.state_dict_loader", "numpy.load", "dcp.load", "np.load",
        "safetensors.torch.load_file", "safetensors.torch.load", "safetensors.torch.safe_open",
        "safetensors.safe_open", "safetensors.deserialize", "safe_open",
    },
    "targets": {"hydra.utils.instantiate", "hydra.utils.call", "instantiate"},
}  # fmt: skip


def names_used(module: str) -> set[str]:
    """Every module imported and every dotted name read in `module` (`torch.load`, `pickle`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Attribute):
            parts = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                found.add(".".join([value.id, *reversed(parts)]))
        elif isinstance(node, ast.Name):
            found.add(node.id)
    return found


def used_outside_its_door() -> dict[str, list[str]]:
    return {
        module: sorted(
            name
            for door, names in DOORS.items()
            if module != door and not module.startswith(f"{door}.")
            for name in names_used(module)
            if any(name == gate or name.startswith(gate + ".") for gate in names)
        )
        for module in MODULES
    }


def test_untrusted_files_are_read_and_configs_built_only_behind_their_doors() -> None:
    """No module outside the `checkpointing.door` package unpickles, calls `torch.load` or a
    safetensors loader, or hands a folder to a torch.distributed.checkpoint loader; none but
    `targets` calls Hydra's instantiate."""
    assert {module: found for module, found in used_outside_its_door().items() if found} == {}


def test_the_door_check_sees_a_call_written_anywhere(tmp_path: Path) -> None:
    probe = tmp_path / "door_probe.py"
    source = "import pickle\nimport torch\nx = torch.load('f')\n"
    source += "from hydra.utils import instantiate\n"
    source += "import safetensors.torch\ny = safetensors.torch.load_file('f')\n"
    source += "from safetensors import safe_open\n"
    try:
        probe.write_text(source)
        MODULES["door_probe"] = probe
        MODULES["checkpointing.doorway"] = probe  # a name that only begins like the door's
        found = used_outside_its_door()
        assert found["door_probe"] == [
            "hydra.utils.instantiate", "instantiate", "pickle", "safe_open",
            "safetensors.safe_open", "safetensors.torch.load_file", "torch.load",
        ]  # fmt: skip
        assert found["checkpointing.doorway"] == found["door_probe"]
    finally:
        MODULES.pop("door_probe", None)
        MODULES.pop("checkpointing.doorway", None)
{%- if cookiecutter.examples != "vision" %}


def test_the_bench_peer_is_written_apart_from_the_project_models() -> None:
    """The nanoGPT-style peer that the bench measures us against has its own model and loop: it
    imports none of the project's models (a change to ours cannot change the peer)."""
    assert {top(target) for target in GRAPH["recipes.bench.peer"]} <= {"recipes", "targets"}
{%- endif %}
