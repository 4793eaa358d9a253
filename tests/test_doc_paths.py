"""Every scripts/... path the documentation names exists (issue 55): the README, docs/, the config docstrings, and the
project's own source (docstrings, error messages, tests' commands), so that a script moved or renamed cannot leave a
command a reader copies pointing at nothing."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A path of this repository's scripts: "scripts/" at the start of a word (not inside another path, such as a
# repository's "flow_grpo/scripts/..."), running to its last letter or digit (a sentence's full stop is not part of it)
SCRIPT_PATH = re.compile(r"(?<![\w./-])scripts/[\w./-]*\w")

# Other repositories' scripts that the method notes cite beside their repository and lines (docs/methods.md, the
# parity tests): GRPO codebases keep their trainers in a scripts/ folder too. Not paths of this repository.
ELSEWHERE = ("scripts/train_sd3", "scripts/train_nft_sd3", "scripts/finetune")


def documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    docs += [p for p in (ROOT / "DEVELOPERS.md",) if p.exists()]
    for top in ("config", "recam", "rewards", "scripts", "tests"):
        docs += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh", ".yaml"))
    return docs + [ROOT / ".ci" / "run", ROOT / "pyproject.toml"]


def named_paths(text: str) -> list[str]:
    return [m.group(0) for m in SCRIPT_PATH.finditer(text) if not m.group(0).startswith(ELSEWHERE)]


def test_the_pattern_finds_this_repositorys_paths_only():
    text = ("run `python scripts/train_recam.py --config x` and scripts/tools/import_graph.py. Beside it, "
            "flow_grpo/scripts/train_sd3.py and DiffusionNFT `scripts/train_nft_sd3.py` L662; scripts/<name>.py")
    assert named_paths(text) == ["scripts/train_recam.py", "scripts/tools/import_graph.py"]


def test_every_scripts_path_named_in_the_documentation_exists():
    missing = []
    for doc in documents():
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            missing += [f"{doc.relative_to(ROOT)}:{n}: {path}" for path in named_paths(line)
                        if not (ROOT / path).exists()]
    assert missing == [], "named but not there (moved? renamed?):\n" + "\n".join(missing)
