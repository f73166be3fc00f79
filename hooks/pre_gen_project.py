"""Validate the answers before cookiecutter writes the project.

On a bad answer: print one line that names the field, the value and the rule, and exit 1.
Cookiecutter then removes the project directory it had just created, so nothing is left on disk.
"""

import json
import keyword
import re
import sys

# Answers arrive as JSON inside a raw string: `tojson` escapes quotes, so no answer can end the
# string literal, and json.loads turns the escapes back into the exact text the user typed.
ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")

CHOICES = {
    "python_version": ["3.10", "3.11", "3.12", "3.13"],
    "license": ["MIT", "Apache-2.0", "BSD-3-Clause", "none"],
    "logger": ["wandb", "tensorboard", "csv"],
    "examples": ["both", "vision", "language"],
    "github_actions": ["yes", "no"],
    "dockerfile": ["yes", "no"],
}

# Import names of the generated project's dependencies: a package with one of these names would
# shadow the dependency for every import in the project.
DEPENDENCY_MODULES = {
    "torch",
    "torchvision",
    "torchaudio",
    "torchmetrics",
    "torchdata",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "pytorch_lightning",
    "hydra",
    "hydra_plugins",
    "omegaconf",
    "wandb",
    "tensorboard",
    "numpy",
    "yaml",
    "pytest",
    "ruff",
    "mypy",
    "optuna",
    "submitit",
    "setuptools",
    "pip",
    "tests",
    "test",
    "src",
    "configs",
}

DISTRIBUTION_NAME = re.compile(r"^([a-z0-9]|[a-z0-9][a-z0-9._-]*[a-z0-9])$", re.IGNORECASE)
PACKAGE_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def package_name_problem(name: str) -> str | None:
    if not PACKAGE_NAME.match(name):
        return "must be lowercase ASCII letters, digits and underscores, not starting with a digit"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return "is a Python keyword"
    if name in sys.stdlib_module_names:
        return "shadows the standard-library module of the same name"
    if name in DEPENDENCY_MODULES:
        return "shadows a module the project depends on or uses"
    return None


def problems(answers: dict) -> list[tuple[str, str]]:
    found = []
    for field in ("project_name", "project_slug", "package_name", "description", "author_name"):
        value = str(answers.get(field, ""))
        if CONTROL_CHARS.search(value):
            found.append((field, "must be a single line without control characters"))
    if not str(answers.get("project_name", "")).strip():
        found.append(("project_name", "must not be empty"))
    slug = str(answers.get("project_slug", ""))
    if not DISTRIBUTION_NAME.match(slug):
        found.append(
            (
                "project_slug",
                "must be a valid distribution name: ASCII letters, digits, '-', '_' and '.', "
                "starting and ending with a letter or digit",
            )
        )
    package_problem = package_name_problem(str(answers.get("package_name", "")))
    if package_problem:
        found.append(("package_name", package_problem))
    email = str(answers.get("author_email", ""))
    if email and not EMAIL.match(email):
        found.append(("author_email", "must look like name@example.com, or be empty"))
    for field, allowed in CHOICES.items():
        if answers.get(field) not in allowed:
            found.append((field, "must be one of " + ", ".join(allowed)))
    return found


def main() -> int:
    found = problems(ANSWERS)
    if not found:
        return 0
    field, rule = found[0]
    print(
        f"ERROR: {field}={ANSWERS.get(field)!r} {rule}. Answer again with a valid {field}.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
