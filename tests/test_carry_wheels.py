"""scripts/tools/carry_wheels.py: the wheels an accelerator machine without network installs, downloaded for its Python
(3.12), installed offline, and imported from where they went."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("carry_wheels", ROOT / "scripts" / "tools" / "carry_wheels.py")
carry_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(carry_wheels)


def test_the_carried_wheels_install_offline_and_are_what_gets_imported(tmp_path):
    wheels = tmp_path / "wheels"
    listing = carry_wheels.download(wheels, "3.12")
    assert listing.read_text().splitlines() == carry_wheels.pins()
    assert len(list(wheels.glob("*.whl"))) == len(carry_wheels.carried())
    assert all(p.name.endswith("-none-any.whl") for p in wheels.glob("*.whl"))  # pure Python: any platform
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--find-links", str(wheels), "--target", str(site), "-r", str(listing)],
                   check=True)
    code = ("import diffusers, ml_collections, absl, importlib_metadata, lazy_importer; from config import grpo; "
            "grpo.get_config('recam_wan_1_3b_8npu'); print(diffusers.__file__); print(ml_collections.__file__); "
            "print(lazy_importer.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    assert [line.startswith(str(site)) for line in out.stdout.split()] == [True, True, True], out.stdout


def test_what_the_carried_packages_need_is_carried_unless_the_machine_has_it(monkeypatch):
    """The list is closed under the packages' own requirements, read from their metadata: importlib_metadata 10
    imports lazy-importer (the H200 window installed it by hand); requirements behind an extra or a marker false on
    the machine's Python 3.12 (tomli, for Python < 3.11) are not carried."""
    names = carry_wheels.carried()
    assert names[:len(carry_wheels.CARRIED)] == list(carry_wheels.CARRIED) and "lazy-importer" in names
    assert not {"numpy", "pillow", "safetensors", "pytest", "tomli"} & {n.lower() for n in names}
    fake = {"a": ["b>=1", "c; python_version < '3.11'", "d; extra == 'test'", "numpy"], "b": [], "c": [], "d": []}
    monkeypatch.setattr(carry_wheels.importlib.metadata, "requires", fake.__getitem__)
    assert carry_wheels.carried(("a",), ("numpy",)) == ["a", "b"]
    assert carry_wheels.carried(("a",), ("numpy",), python_version="3.10") == ["a", "b", "c"]
