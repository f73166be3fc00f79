"""A project baked with one example only documents that example: its README.md and docs/*.md
name nothing of the other (Jinja conditionals in the docs leave those passages out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import Bake

# Words that only the other example's passages use (word boundaries keep out the generic uses:
# "bf16 matrix instructions", "hex digits", "summary.png"; a ViT has tokens too).
LANGUAGE_WORDS = [
    r"\bGPT", r"tokeni[sz]er", r"tokens/s", r"token[-_ ]shards?", r"\binstruct\b",
    r"instruct_lora", r"\bchat\b", r"\bprompts?\b", r"\bLoRA\b", r"language model",
    r"experiment=language", r"stdlib_text", r"\bBPE\b", r"byte-level", r"\bvocab",
]  # fmt: skip
VISION_WORDS = [
    r"\bmnist\b", r"image[_-]folder", r"\bconvnet\b", r"\bpixels?\b", r"classif(y|ier|ication)",
    r"(?<!hex )(?<!letters, )\bdigits\b", r"experiment=digits", r"\bPillow\b", r"\bJPEG\b",
]  # fmt: skip
OTHER_EXAMPLE = {"vision": LANGUAGE_WORDS, "language": VISION_WORDS}


def mentions(project: Path, words: list[str]) -> list[str]:
    """`file:line: word` for each word of `words` in the project's README.md and docs/*.md."""
    pattern = re.compile("|".join(f"(?:{word})" for word in words), re.IGNORECASE)
    found = []
    for path in [project / "README.md", *sorted((project / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                found.append(f"{path.relative_to(project)}:{number}: {match.group(0)}")
    return found


@pytest.mark.parametrize("example", ["vision", "language"])
def test_the_docs_of_one_example_name_nothing_of_the_other(bake: Bake, example: str) -> None:
    result = bake(examples=example, logger="csv")
    assert result.exit_code == 0, result.exception
    project = Path(result.project_path)
    assert mentions(project, OTHER_EXAMPLE[example]) == []
    other = "language" if example == "vision" else "vision"
    assert mentions(project, OTHER_EXAMPLE[other]), "the words of its own example are there"
