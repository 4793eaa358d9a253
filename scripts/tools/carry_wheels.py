"""Wheel files of what a bare accelerator machine lacks, for an install there with no network.

The GPU machines within reach have Python 3.12 and PyTorch with CUDA, accelerate, peft, safetensors, scipy,
OpenCV, imageio, tqdm, matplotlib, httpx and transformers, but not diffusers or ml_collections, and reach no
package index. Everything else recam imports there is optional: wandb only when logging is on, pycolmap only for
the SfM camera estimator, imageio-ffmpeg only to read or write mp4 (GIFs need none). So, on a machine with an
index:

    python scripts/tools/carry_wheels.py --dest wheels

and on the accelerator machine, with wheels/ carried along:

    pip install --no-index --find-links wheels -r wheels/carried.txt
    python scripts/device_check.py --out runs/device_check

The wheels are pure Python (any platform, Python >= 3.9), pinned to the versions installed where this runs, which
are the versions the tests passed with.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

# what the accelerator machine lacks; carried() adds what they need that it lacks too
CARRIED = ("diffusers", "importlib_metadata", "zipp", "ml_collections", "absl-py")
# what it has (the docstring's list), with what those bring along that the carried packages also need
PRESENT = ("torch", "numpy", "accelerate", "peft", "safetensors", "scipy", "opencv-python", "imageio", "tqdm",
           "matplotlib", "httpx", "transformers", "huggingface-hub", "filelock", "regex", "requests", "pyyaml",
           "pillow", "packaging")
LIST_NAME = "carried.txt"


def carried(roots=CARRIED, present=PRESENT, python_version: str = "3.12") -> list[str]:
    """roots and, transitively, each requirement of theirs that the machine lacks (extras left out, markers read for
    its Python), as installed here: importlib_metadata 10 imports lazy-importer, which a fixed list missed. A
    requirement not installed here cannot be pinned: a SystemExit that names it."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = {**default_environment(), "python_version": python_version, "python_full_version": f"{python_version}.0",
           "extra": ""}
    have = {canonicalize_name(n) for n in present}
    out, todo = [], list(roots)
    while todo:
        name = todo.pop(0)
        if canonicalize_name(name) in have:
            continue
        have.add(canonicalize_name(name))
        out.append(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here, so its wheel cannot be pinned: pip install it") from None
        todo += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate(env)]
    return out


def pins(names=None) -> list[str]:
    """name==version of each carried package (carried()) as installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in (carried() if names is None else names)]


def download(dest: Path, python_version: str = "3.12") -> Path:
    """Download the pinned wheels (no dependencies resolved: the list is the whole set) into `dest` and write
    `dest/carried.txt`, the requirement list an offline install reads. Returns that list's path."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = pins()
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", "--python-version", python_version, "--dest", str(dest), *wanted],
                   check=True)
    listing = dest / LIST_NAME
    listing.write_text("\n".join(wanted) + "\n")
    return listing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default="wheels", help="folder for the wheels and carried.txt")
    ap.add_argument("--python-version", default="3.12", help="the accelerator machine's Python")
    args = ap.parse_args(argv)
    listing = download(Path(args.dest), args.python_version)
    wheels = sorted(p.name for p in Path(args.dest).glob("*.whl"))
    size = sum(p.stat().st_size for p in Path(args.dest).glob("*.whl")) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB, in {args.dest}; install there with: "
          f"pip install --no-index --find-links {args.dest} -r {listing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
