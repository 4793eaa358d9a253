"""Benchmark ReCam-Tiny's forward and forward + backward with the last block trimmed to the target tokens or not.

    python scripts/bench/bench_model.py [--batch 8] [--repeats 5] [--iters 10] [--threads 2]

Both settings run in one process on the same inputs, interleaved round by round so that machine noise hits both
alike; each round's time is the median over --iters calls, and the table shows the median over --repeats rounds
and the ratio untrimmed / trimmed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from recam.domains.camera.model import ReCamTransformer3DModel, tiny_config  # noqa: E402


def timed(fn, iters: int) -> float:
    """Median wall time of `iters` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="checkpoints/recam_tiny_base", help="model folder ('' = tiny_config)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = (ReCamTransformer3DModel.from_pretrained(args.checkpoint) if args.checkpoint
             else ReCamTransformer3DModel(**tiny_config()))
    frames, size = 8, 32  # the embedded default's videos (tiny_cpu: data.num_frames, data.size)
    g = torch.Generator().manual_seed(1)
    shape = (args.batch, model.config.in_channels, frames, size, size)
    inputs = (torch.randn(shape, generator=g), torch.rand(args.batch, generator=g), torch.randn(shape, generator=g),
              torch.randn(args.batch, frames, 3, 4, generator=g), torch.randn(args.batch, frames, 3, 4, generator=g))

    def forward():
        with torch.no_grad():
            model(*inputs)

    def forward_backward():
        model(*inputs).square().mean().backward()

    rounds: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for trim in (False, True):
            model.trim_last_block = trim
            for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
                rounds.setdefault((name, trim), []).append(timed(fn, args.iters))
    print(f"ReCam-Tiny, batch {args.batch}, {args.threads} threads, median of {args.repeats} rounds x "
          f"{args.iters} calls")
    print("| pass | all tokens (s) | last block trimmed (s) | ratio |")
    print("|---|---|---|---|")
    for name in ("forward", "forward+backward"):
        full, trim = (statistics.median(rounds[(name, t)]) for t in (False, True))
        print(f"| {name} | {full:.4f} | {trim:.4f} | {full / trim:.2f}x |")


if __name__ == "__main__":
    main()
