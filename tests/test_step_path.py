"""scripts/tools/step_path.py: the files a run executes on its way to one optimizer step (docs/architecture.md's
numbers), on the toy preset."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _path(tmp_path, *extra):
    p = subprocess.run([sys.executable, "scripts/tools/step_path.py", "--config", "config/grpo.py:toy",
                        f"--config.run_dir={tmp_path / 'run'}", *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = dict((path, int(n)) for n, path in re.findall(r"^\s+(\d+)\s+(\S+)$", p.stdout, flags=re.M))
    files, lines = map(int, re.search(r"^(\d+) files, (\d+) lines$", p.stdout, flags=re.M).groups())
    assert files == len(rows) and lines == sum(rows.values())  # the total is the table's
    return rows


def test_the_core_path_is_the_loop_and_the_algorithm_without_extensions_or_the_domain(tmp_path):
    core = _path(tmp_path / "core")
    for phase in ("trainer", "rollout", "sampler", "scheduler", "sde", "advantages", "reward_runner", "objective",
                  "losses"):
        assert f"recam/engine/{phase}.py" in core
    # research extensions and side concerns the toy preset does not use stay off the path, and so does the domain
    for off in ("recam/engine/run_checkpoints.py", "config/validate.py", "scripts/train_recam.py"):
        assert off not in core
    assert not any(p.startswith("recam/engine/extensions/") for p in core)
    assert not any(p.startswith("recam/domains/") for p in core)
    assert core["recam/engine/trainer.py"] == len((ROOT / "recam/engine/trainer.py").read_text().splitlines())

    whole = _path(tmp_path / "whole", "--from-start")
    assert set(core) < set(whole)
    assert {"scripts/train_recam.py", "config/validate.py", "recam/domains/toy/domain.py"} <= set(whole)
