"""One prepared check of recam on one accelerator: real-size timings, memory and MFU, and learning at GPU batch sizes.

    python scripts/device_check.py --out runs/device_check              # one NVIDIA GPU, about 8 minutes
    python scripts/device_check.py --out /tmp/device_check --tiny       # every stage at tiny sizes on the CPU
    python scripts/device_check.py --out runs/learning --stages learning --learning-seconds 180
                                                                        # both learning runs, longer: ~10 min
    python scripts/device_check.py --out runs/learning2 --stages learning --learning-seconds 180 \\
        --resume runs/learning                                          # the next window continues them
    python scripts/device_check.py --out runs/placebo --stages learning --learning-arms placebo \\
        --resume docs/learning_gpu                                      # placebos up to the GRPO runs' seconds

Stages run in order, each in a process of its own under its own time cap, and DIR/device_check.json is rewritten
after each one, so a stage that fails or runs out of time keeps what the earlier ones measured (its entry then says
why). DIR/device_check.md summarises the same numbers. Each stage is a module of scripts/device_stages/ with its
sizes, its cap and the keys it reports; this file runs them:

  peak      a measured matmul (bf16 on an accelerator, fp32 on the CPU): `peak_tflops`, what MFU is read against.
  recam     the ReCam transformer at Wan2.1-T2V-1.3B size (published config, random init), frozen bf16 base, LoRA
            and gradient checkpointing as preset recam_wan_1_3b_8npu sets them, text embeddings of umT5's shape,
            source and target latents of an 81 x 480 x 832 clip (16 x 21 x 60 x 104), k copies of one condition,
            through the engine's own rollout and GRPO objective (the calls the trainer makes): seconds per
            sampling step and per trained step (policy forward + backward, reference forward, log-probs, KL),
            peak memory, MFU, the first trained step's |ratio - 1| under bf16 and fp16 autocast, adapter save and
            load, and the epoch time the preset's step counts imply.
  vae       the Wan VAE from its config (random init) encoding and decoding one 81 x 480 x 832 clip.
  motion    MDM's size (8 layers, 512 wide) on a batch of 64 x 196 frames, 50 DDIM steps with guidance.
  fsdp      one smoke epoch through config/accelerate/fsdp.yaml on one GPU (skipped on the CPU: accelerate's
            FSDP plugin needs an accelerator).
  learning  presets tiny_gpu and motion_tiny_gpu run by scripts/train_recam.py within a time cap each: the
            held-out curve (an evaluation every few updates, drawn in DIR/learning_<domain>.png), the base and
            final scores and the gain with its 95% interval over conditions, seconds per update and the device's
            busy share. The runs add up over GPU windows: --resume DIR continues each run DIR/runs/<preset> of an
            earlier check for --learning-seconds more training seconds, and each run folder is left as a small
            bundle (the checkpoint `latest` names and `selected`'s, metrics.jsonl gzipped) to bring back for that.
            --learning-arms grpo,placebo runs each preset's placebo (advantage.placebo=True) after it, in
            DIR/runs/<preset>_placebo, until it has trained as many seconds as the GRPO run has in all; `placebo`
            alone trains no GRPO run and matches the ones in --resume. learning.<domain>.vs_placebo: GRPO minus
            placebo, paired over the held-out conditions, at the last update both evaluated and at the ends.
  overhead  per stage, the share of its wall time spent outside the model's forward / backward passes (the
            passes timed alone at the same shapes).

Random weights time exactly like trained ones; they only make the learning stage's scores meaningless, which is
why that stage uses the committed embedded bases instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.device_stages import Context, fsdp, learning, motion, peak, recam, report, vae  # noqa: E402

STAGE_MODULES = {"peak": peak, "recam": recam, "vae": vae, "motion": motion, "fsdp": fsdp, "learning": learning}
STAGES = tuple(STAGE_MODULES)
# Sizes per mode, each stage's own: "full" the real workload, "tiny" the same code paths at sizes a 2-core CPU runs
# in seconds; "caps" the stages' time caps. Full caps: 480 s in all, so the whole check fits one 10-minute command
# with room to spare. Tiny caps only end a hung stage: a machine busy with other jobs (a CI beside training runs)
# takes two to three times a quiet one's seconds, which a tiny run must survive.
SIZES = {mode: {**{name: m.SIZES[mode] for name, m in STAGE_MODULES.items()},
                "caps": {name: m.CAP[mode] for name, m in STAGE_MODULES.items()}} for mode in ("full", "tiny")}


def set_learning(mode: str, seconds: float | None, presets: str | None, arms: str | None = None,
                 resume: Path | None = None) -> None:
    """--learning-seconds / --learning-presets / --learning-arms: a longer learning run, one domain, or the placebo
    arm, in a window of its own. The stage's cap grows with the training time asked for: each run's training
    seconds and its margin (learning.allowance), a placebo's seconds being what it lacks of its GRPO run's
    cumulative seconds (read from the --resume bundles)."""
    size = SIZES[mode]["learning"]
    if arms:
        wanted = tuple(x.strip() for x in arms.split(",") if x.strip())
        unknown = sorted(set(wanted) - set(learning.ARMS))
        if unknown or not wanted:
            raise SystemExit(f"--learning-arms: unknown {unknown}; choose from {list(learning.ARMS)}")
        size["arms"] = tuple(a for a in learning.ARMS if a in wanted)  # GRPO first: its placebo matches its budget
    if presets:
        wanted = tuple(x.strip() for x in presets.split(",") if x.strip())
        unknown = sorted(set(wanted) - set(learning.SCORES))
        if unknown:
            raise SystemExit(f"--learning-presets: unknown {unknown}; choose from {sorted(learning.SCORES)}")
        size["presets"] = wanted
    if seconds is not None:
        if not seconds > 0:  # the runs' num_epochs never ends them: the cap does
            raise SystemExit(f"--learning-seconds must be positive, got {seconds:g}")
        size["seconds"] = seconds
    if seconds is not None or "placebo" in size["arms"]:
        SIZES[mode]["caps"]["learning"] = sum(learning.allowance(arm, s) for _, arm, s in learning.plans(
            size, resume)) + 10


def run_stage(name: str, mode: str, work: Path, out_dir: Path, peak_tflops: float | None,
              resume: Path | None = None) -> dict:
    """One stage in this process (the child side of `main`)."""
    device = torch.device("cuda" if torch.cuda.is_available() and mode == "full" else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    ctx = Context(work, out_dir, SIZES[mode]["caps"][name], peak_tflops, resume)
    return STAGE_MODULES[name].run(device, SIZES[mode][name], ctx)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for device_check.json and device_check.md")
    ap.add_argument("--tiny", action="store_true", help="every stage at tiny sizes, on the CPU")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ", ".join(STAGES))
    ap.add_argument("--learning-seconds", type=float, default=None,
                    help="training seconds per learning run (default 30; the stage's cap follows)")
    ap.add_argument("--learning-presets", default=None,
                    help="comma-separated subset of the learning presets: " + ", ".join(learning.SCORES))
    ap.add_argument("--learning-arms", default=None,
                    help="comma-separated: grpo (the default) and/or placebo, each preset's run with "
                         "advantage.placebo=True in runs/<preset>_placebo, trained to its GRPO run's cumulative "
                         "training seconds; placebo alone continues no GRPO run: it matches those in --resume")
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="a previous check's --out folder: continue each learning run DIR/runs/<preset> there is "
                         "for --learning-seconds more training seconds")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    ap.add_argument("--peak-tflops", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = "tiny" if args.tiny else "full"
    resume = Path(args.resume) if args.resume else None
    if resume is not None and not (resume / "runs").is_dir():
        ap.error(f"--resume {resume}: no runs/ folder there (the --out of a check with the learning stage)")
    set_learning(mode, args.learning_seconds, args.learning_presets, args.learning_arms, resume)
    if args.stage:  # child: one stage, its result as JSON in a file the parent reads
        with tempfile.TemporaryDirectory() as tmp:
            result = run_stage(args.stage, mode, Path(tmp), out_dir, args.peak_tflops, resume)
        (out_dir / f".stage_{args.stage}.json").write_text(json.dumps(result, default=str))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    results = {"device": report.device_name(device), "torch": torch.__version__, "mode": mode, "stages": {},
               "attention": report.attention_backends(device), "torch_compile": "off (recam never compiles)"}
    t_start = time.perf_counter()
    for name in [x.strip() for x in args.stages.split(",") if x.strip()]:
        if name not in STAGES:
            ap.error(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
        cap = SIZES[mode]["caps"][name]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out_dir), "--stage", name,
               *(["--tiny"] if args.tiny else []),
               *(["--learning-seconds", str(args.learning_seconds)] if args.learning_seconds is not None else []),
               *(["--learning-presets", args.learning_presets] if args.learning_presets else []),
               *(["--learning-arms", args.learning_arms] if args.learning_arms else []),
               *(["--resume", str(resume)] if resume is not None else []),
               *(["--peak-tflops", str(results["peak_tflops"])] if results.get("peak_tflops") else [])]
        t0 = time.perf_counter()
        staged = out_dir / f".stage_{name}.json"
        staged.unlink(missing_ok=True)
        try:
            # each stage in its own process: its cap is enforced, its peak memory is its own, and an
            # out-of-memory or a crash there leaves the other stages' numbers standing
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=cap)
            if p.returncode == 0 and staged.exists():
                results[name] = json.loads(staged.read_text())
                status = "skipped" if "skipped" in results[name] else "ok"
                if any(isinstance(v, dict) and "error" in v for v in results[name].values()):
                    status = "error"  # a part of it (a learning run) failed: its entry says why
            else:
                results[name], status = {"error": (p.stderr or p.stdout)[-3000:] or f"exit {p.returncode}"}, "error"
        except subprocess.TimeoutExpired:
            results[name], status = {"error": f"did not finish within its cap of {cap} s"}, "timeout"
        staged.unlink(missing_ok=True)
        seconds = time.perf_counter() - t0
        results["stages"][name] = {"status": status, "seconds": seconds, "cap_s": cap}
        if name == "peak" and status == "ok":
            results["peak_tflops"] = results["peak"]["peak_tflops"]
        results["overhead"] = report.overhead(results)
        results["wall_s"] = time.perf_counter() - t_start
        report.write(out_dir, results)
        print(f"[device_check] {name}: {status} in {seconds:.1f} s", flush=True)
    return 0 if all(s["status"] in ("ok", "skipped") for s in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
