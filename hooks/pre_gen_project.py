"""Validate the answers before cookiecutter writes the project.

On a bad answer: print one line that names the field, the value and the rule, and exit 1.
Cookiecutter then removes the project directory it had just created, so nothing is left on disk.
"""

import json
import keyword
import re
import sys
import unicodedata

# Answers arrive as JSON inside a raw string: `tojson` escapes quotes, so no answer can end the
# string literal, and json.loads turns the escapes back into the exact text the user typed.
ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")

CHOICES = {
    "python_version": ["3.10", "3.11", "3.12", "3.13"],
    "license": ["MIT", "Apache-2.0", "BSD-3-Clause", "none"],
    "logger": ["wandb", "tensorboard", "mlflow", "csv"],
    "examples": ["both", "vision", "language"],
    "github_actions": ["yes", "no"],
    "dockerfile": ["yes", "no"],
}

# Import names that a package of the same name would shadow in the generated project: every
# top-level module or package that the files of its dependency closure install (dependencies,
# extras, dev tools). `python -m tests.dependency_modules` computes them into
# hooks/dependency_modules.txt (a template test fails when it is stale); Jinja renders them here.
DEPENDENCY_MODULES = set(json.loads(r"""{{ dependency_modules() | tojson }}"""))
# The project's own top-level folders and packages.
PROJECT_MODULES = {"tests", "test", "src", "configs", "hydra_plugins"}
# Standard-library modules of the Pythons the project supports (3.10 to 3.13) that the Python
# running cookiecutter may not list in sys.stdlib_module_names: removed in 3.12 (distutils,
# asynchat, asyncore, imp, smtpd) or 3.13 (PEP 594), or added in 3.11 (tomllib).
STDLIB_OF_OTHER_PYTHONS = {
    "asynchat", "asyncore", "distutils", "imp", "smtpd",
    "aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "lib2to3", "mailcap",
    "msilib", "nis", "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau", "telnetlib",
    "uu", "xdrlib",
    "tomllib",
}  # fmt: skip
# Longer package names make the generated imports and entry points too long for its own lint.
MAX_PACKAGE_NAME = 64

# A folder name that stays short enough for every file name pip and hatchling derive from it.
MAX_PROJECT_SLUG = 100
# Modules Python's `site` imports at every start of the interpreter (Debian's Python ships its own
# `sitecustomize`, which would then shadow the package).
SITE_MODULES = {"sitecustomize", "usercustomize"}

# The patterns are matched whole (fullmatch: `$` alone lets a trailing newline through) and in
# ASCII mode, with explicit ASCII classes and no IGNORECASE: with IGNORECASE, [a-z] also matches
# the Kelvin sign (U+212A) and the long s (U+017F). The text is also checked with str.isascii().
DISTRIBUTION_NAME = re.compile(r"[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9]", re.ASCII)
PACKAGE_NAME = re.compile(r"[a-z_][a-z0-9_]*", re.ASCII)
# What packaging metadata takes without quoting: name@host.domain in plain ASCII.
EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+", re.ASCII)
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
# Cookiecutter renders answers given with --no-input or --extra-context as Jinja templates;
# local_extensions.py refuses them before that, and this hook refuses what reaches it another way
# (a typed answer), so that no project holds an answer that a later `cruft update` would render.
# (Spelled in pieces: this file is itself rendered by Jinja.)
JINJA_SYNTAX = tuple("{" + second for second in ("{", "%", "#"))
JINJA_RULE = (
    f"contains Jinja syntax ({', '.join(JINJA_SYNTAX)}), which cannot appear in an answer "
    "(cookiecutter would run it as a template)"
)
FREE_TEXT = ("project_name", "project_slug", "package_name", "description", "author_name")


def not_ascii(value: str) -> str:
    """Names the first character that is not ASCII: U+212A (the Kelvin sign) looks like K."""
    for character in value:
        if not character.isascii():
            name = unicodedata.name(character, "a character")
            return f" ({name}, U+{ord(character):04X}, is not ASCII)"
    return ""


def package_name_problem(name: str) -> str | None:
    if not (name.isascii() and PACKAGE_NAME.fullmatch(name)):
        return (
            "must be lowercase ASCII letters, digits and underscores, not starting with a digit"
            + not_ascii(name)
        )
    if len(name) > MAX_PACKAGE_NAME:
        return f"is {len(name)} characters long; use at most {MAX_PACKAGE_NAME}"
    if name.startswith("__") and name.endswith("__"):
        # __main__ is the running program (the console scripts could not import the package);
        # __pycache__ is skipped by the build and the tools; Python reserves all such names.
        return "has the __x__ form that Python reserves for its own names (__main__, __init__)"
    if name in SITE_MODULES:
        return "is a module Python's site imports at every interpreter start"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return "is a Python keyword"
    if name in sys.stdlib_module_names or name in STDLIB_OF_OTHER_PYTHONS:
        return "shadows the standard-library module of the same name"
    if name in DEPENDENCY_MODULES:
        return "shadows a module that the project's dependencies install"
    if name in PROJECT_MODULES:
        return "is the name of one of the project's own folders or packages"
    return None


def not_utf8(value: str) -> str | None:
    """A byte that was not UTF-8 (`caf\\xe9` on the command line or typed in a Latin-1 terminal)
    reaches Python as a lone surrogate, which no file can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        character = ord(value[error.start])
        if 0xDC80 <= character <= 0xDCFF:
            return f"holds the byte 0x{character - 0xDC00:02X}, which is not UTF-8 text"
        return f"holds U+{character:04X}, a lone surrogate that is not text"
    return None


def problems(answers: dict) -> list[tuple[str, str]]:
    found = []
    asked = [*FREE_TEXT, "author_email", *CHOICES]
    for field in asked + sorted(set(answers) - set(asked)):
        value = answers.get(field)
        problem = not_utf8(value) if isinstance(value, str) else None
        if problem and not field.startswith("_"):
            found.append((field, problem))
    for field in (*FREE_TEXT, "author_email"):
        if any(syntax in str(answers.get(field, "")) for syntax in JINJA_SYNTAX):
            found.append((field, JINJA_RULE))
    for field in FREE_TEXT:
        value = str(answers.get(field, ""))
        if CONTROL_CHARS.search(value):
            found.append((field, "must be a single line without control characters"))
    if not str(answers.get("project_name", "")).strip():
        found.append(("project_name", "must not be empty"))
    slug = str(answers.get("project_slug", ""))
    if not (slug.isascii() and DISTRIBUTION_NAME.fullmatch(slug)):
        found.append(
            (
                "project_slug",
                "must be a valid distribution name: ASCII letters, digits, '-', '_' and '.', "
                "starting and ending with a letter or digit" + not_ascii(slug),
            )
        )
    elif len(slug) > MAX_PROJECT_SLUG:
        found.append(
            ("project_slug", f"is {len(slug)} characters long; use at most {MAX_PROJECT_SLUG}")
        )
    package_problem = package_name_problem(str(answers.get("package_name", "")))
    if package_problem:
        found.append(("package_name", package_problem))
    email = str(answers.get("author_email", ""))
    if email and not (email.isascii() and EMAIL.fullmatch(email)):
        found.append(
            (
                "author_email",
                "must look like name@example.com (ASCII, no quotes), or be empty"
                + not_ascii(email),
            )
        )
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
