"""Every third-party import of the project is declared: a fresh `pip install -r requirements.txt` must be enough to
run the README's two commands, so a package that only the developer's machine happens to have fails here, not for
a user. pyproject.toml's dependencies name the same packages."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("recam", "rewards", "config", "scripts", "tests", "conftest.py")
FIRST_PARTY = {"recam", "rewards", "config", "scripts", "tests", "conftest"}
# Imports that are optional by design, each imported only where present and never a requirement.
OPTIONAL = {"torch_npu": "Ascend NPU builds of torch bring it (recam/infra/distributed.py imports it when present)"}


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): case-insensitive, runs of -_. are one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(text: str) -> set[str]:
    """The distribution names of a requirements file's lines (pins, markers and comments dropped)."""
    names = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(normalise(re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0]))
    return names


def top_level_imports(paths) -> dict[str, str]:
    """Absolute imports' top-level module -> the first file importing it, over every .py file under `paths`
    (function-level imports included: they run too)."""
    found: dict[str, str] = {}
    for base in paths:
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for path in files:
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def undeclared(imports: dict[str, str], declared: set[str]) -> list[str]:
    """One line per third-party import whose distribution `declared` does not name."""
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(imports.items()):
        if module in sys.stdlib_module_names or module in FIRST_PARTY or module in OPTIONAL:
            continue
        dists = {normalise(d) for d in providers.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported by {where}) is not installed and not declared")
        elif not dists & declared:
            problems.append(f"{module} (imported by {where}) comes from {sorted(dists)}, not in requirements.txt")
    return problems


def test_every_third_party_import_is_in_requirements():
    imports = top_level_imports([ROOT / p for p in SCANNED])
    assert {"torch", "scipy", "cv2", "PIL"} <= set(imports)  # the scan sees real imports
    declared = requirement_names((ROOT / "requirements.txt").read_text())
    assert undeclared(imports, declared) == []


def test_a_removed_requirement_is_named():
    text = (ROOT / "requirements.txt").read_text()
    without_scipy = "\n".join(line for line in text.splitlines() if not line.startswith("scipy"))
    problems = undeclared(top_level_imports([ROOT / p for p in SCANNED]), requirement_names(without_scipy))
    assert len(problems) == 1 and problems[0].startswith("scipy (imported by ") and "['scipy']" in problems[0]


def test_requirement_names_parses_pins_markers_and_comments():
    text = ("# a comment\ntorch==2.13.0\nml_collections>=0.1.1\npycolmap>=4.2  # SfM\nPillow\n-e .\n"
            "foo[bar]; python_version<'4'\n")
    assert requirement_names(text) == {"torch", "ml-collections", "pycolmap", "pillow", "foo"}


def test_pyproject_declares_what_requirements_does():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = requirement_names("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
    assert listed == requirement_names((ROOT / "requirements.txt").read_text())
