"""scripts/tools/import_graph.py: cycles found in a hand-made graph, imports read from source (relative, lazy, and
TYPE_CHECKING-only ones), and the project's own graph readable end to end."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.tools import import_graph  # noqa: E402


def test_cycles_are_the_strongly_connected_components():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"], ["d", "e"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_read_from_source(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nimport pkg.x\nfrom . import y\n"
                   "if TYPE_CHECKING:\n    from pkg import hidden\n"
                   "def f():\n    from pkg.z import thing\n")
    known = {"pkg.x", "pkg.y", "pkg.z", "pkg.hidden", "pkg.mod"}
    got = import_graph.imports_of(src, "pkg.mod", known)
    assert got == {"pkg.x", "pkg.y", "pkg.z"}  # a lazy import counts; a TYPE_CHECKING one does not


def test_the_project_graph_and_the_entry_points_reach():
    text = import_graph.main(["--reach", "scripts/train_recam.py", "--also", "recam/domains/toy/domain.py"])
    assert "| recam.engine |" in text and "package import cycles:" in text
    assert "- recam/engine/trainer.py (" in text and "- recam/domains/toy/domain.py (" in text


LAYERS = ("recam.infra", "recam.engine", "rewards", "recam.domains", "config", "scripts")  # bottom to top


def _layer(package: str) -> int | None:
    """The index in LAYERS of `package` (rewards.pose counts as rewards, recam.domains.camera as recam.domains)."""
    found = [i for i, top in enumerate(LAYERS) if package == top or package.startswith(top + ".")]
    return found[0] if found else None


def test_the_repository_has_no_package_cycle_and_imports_only_downwards():
    edges, files = import_graph.graph()
    packages = import_graph.package_edges(edges, files)
    assert import_graph.cycles(packages) == []
    engine = {dst for src, dsts in packages.items() if _layer(src) == LAYERS.index("recam.engine") for dst in dsts}
    assert not [d for d in engine if d == "config" or d.startswith(("recam.domains", "rewards"))], engine
    infra = {dst for src, dsts in packages.items() if _layer(src) == LAYERS.index("recam.infra") for dst in dsts}
    assert not [d for d in infra if d == "config" or d.startswith(("recam.engine", "recam.domains", "rewards"))], infra
    upward = sorted(f"{src} -> {dst}" for src, dsts in packages.items() for dst in dsts
                    if _layer(src) is not None and _layer(dst) is not None and _layer(dst) > _layer(src))
    assert upward == []


def test_the_core_engine_never_imports_its_research_extensions():
    # package_edges leaves out edges between a package and its subpackages, so the cycle check alone would not see
    # recam.engine importing recam.engine.extensions: the core names them by string in its registries instead
    edges, files = import_graph.graph()
    core = {m: ts for m, ts in edges.items() if import_graph.package_of(m, files) == "recam.engine"}
    assert "recam.engine.trainer" in core and "recam.engine.objective" in core
    into = sorted(f"{m} -> {t}" for m, ts in core.items() for t in ts if t.startswith("recam.engine.extensions"))
    assert into == []


def test_no_two_files_import_each_other_and_infra_imports_nothing_above_it():
    # a cycle between files hides inside a package, where package_edges does not look (containers <-> rollout and
    # reports <-> runlog were two, issue 55); infra importing the engine would be infra knowing what GRPO records
    edges, files = import_graph.graph()
    assert import_graph.cycles(edges) == []
    assert import_graph.infra_imports_above(edges, files) == []
    text = import_graph.main([])
    assert "file import cycles: 0" in text and "imports from recam.infra into the packages above it: 0" in text


def test_importing_a_module_from_its_package_is_an_edge_to_the_module_alone(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from pkg import sub\nfrom pkg import thing\n")
    got = import_graph.imports_of(src, "other.mod", {"pkg", "pkg.sub"})
    assert got == {"pkg.sub", "pkg"}  # `thing` is no module: it comes from pkg/__init__.py
    src.write_text("from pkg import sub\n")
    assert import_graph.imports_of(src, "other.mod", {"pkg", "pkg.sub"}) == {"pkg.sub"}
