"""Who imports whom in this repository, read from the source (nothing is imported): package-level edges, the cycles
between packages and between files, the imports out of recam.infra, and the project files an entry point reaches
with their line counts.

    python scripts/tools/import_graph.py                                   # packages, edges, cycles
    python scripts/tools/import_graph.py --reach scripts/train_recam.py    # + the files train_recam.py reaches
    python scripts/tools/import_graph.py --reach scripts/train_recam.py --also recam/domains/camera/domain.py

A package is a module's folder (recam/engine/trainer.py -> recam.engine; config/validate.py -> config). Imports
inside functions count (they are imports all the same, only later); `if TYPE_CHECKING:` blocks do not. "Reaches"
follows every import from the entry point, transitively, within the project; a module loaded by name at run time
(a domain, from config.domain) is named with --also, since no import statement leads to it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("config", "recam", "rewards", "scripts")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    """module name -> file, for every Python file of the project's packages and scripts."""
    return {module_name(p): p for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` (module `name`) imports, resolved to the longest known module name."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
            for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import module` names the module, not pkg/__init__.py: a package's __init__ runs before any of
            # its modules whichever way they are imported, and is counted as an edge for none of them
            if not all(t in known for t in targets):
                targets.append(base)
        for target in targets:
            parts = target.split(".")
            for i in range(len(parts), 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in known:
                    if candidate != name:
                        found.add(candidate)
                    break
    return found


def package_of(module: str, files: dict[str, Path]) -> str:
    path = files[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0] or module


def graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    files = project_files()
    known = set(files)
    return {m: imports_of(p, m, known) for m, p in files.items()}, files


def package_edges(edges: dict[str, set[str]], files: dict[str, Path]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges.items():
        src = package_of(module, files)
        for t in targets:
            dst = package_of(t, files)
            if dst != src and not src.startswith(dst + ".") and not dst.startswith(src + "."):
                out[src].add(dst)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts})

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in nodes:
        if v not in index:
            visit(v)
    return sorted(out)


def infra_imports_above(edges: dict[str, set[str]], files: dict[str, Path]) -> list[str]:
    """"module -> module" for each import by a recam.infra module of a project module outside recam.infra: the
    plumbing knows nothing of the engine it serves (what a GRPO record holds is built in recam.engine.records, and
    recam.infra.runlog writes it as given)."""
    def infra(module: str) -> bool:
        return package_of(module, files).startswith("recam.infra")
    return sorted(f"{m} -> {t}" for m, ts in edges.items() if infra(m) for t in ts if not infra(t))


def reach(entry: str, edges: dict[str, set[str]]) -> list[str]:
    seen, todo = {entry}, [entry]
    while todo:
        for t in edges.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return sorted(seen)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reach", type=Path, default=None, help="an entry file: list the project files it reaches")
    p.add_argument("--also", type=Path, action="append", default=[],
                   help="a file loaded by name at run time (a domain module): reached from too")
    args = p.parse_args(argv)
    edges, files = graph()
    pkg = package_edges(edges, files)
    out = ["| package | imports |", "|---|---|"]
    out += [f"| {src} | {', '.join(sorted(dst))} |" for src, dst in sorted(pkg.items())]
    found = cycles(pkg)
    out += ["", f"package import cycles: {len(found)}"] + [f"- {' <-> '.join(c)}" for c in found]
    found = cycles(edges)
    out += [f"file import cycles: {len(found)}"] + [f"- {' <-> '.join(c)}" for c in found]
    up = infra_imports_above(edges, files)
    out += [f"imports from recam.infra into the packages above it: {len(up)}"] + [f"- {x}" for x in up]
    if args.reach is not None:
        entries = [module_name((ROOT / f).resolve()) for f in (args.reach, *args.also)]
        missing = [str(f) for f, e in zip((args.reach, *args.also), entries, strict=True) if e not in files]
        if missing:
            raise SystemExit(f"not project files: {missing}")
        reached = sorted({m for e in entries for m in reach(e, edges)})
        total = sum(lines(files[m]) for m in reached)
        named = " + ".join(str(f) for f in (args.reach, *args.also))
        out += ["", f"{named} reach {len(reached)} project files, {total} lines:"]
        out += [f"- {files[m].relative_to(ROOT)} ({lines(files[m])})" for m in reached]
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
