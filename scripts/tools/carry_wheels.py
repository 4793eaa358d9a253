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

# what the accelerator machine lacks, with the pure-Python packages they need that it lacks too
CARRIED = ("diffusers", "importlib_metadata", "zipp", "ml_collections", "absl-py")
LIST_NAME = "carried.txt"


def pins(names=CARRIED) -> list[str]:
    """name==version of each carried package as installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


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
