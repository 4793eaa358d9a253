"""The gradient noise scale's fields of a metrics.jsonl's epoch records (written by recam.engine.noise_scale),
checked against their own definitions with plain arithmetic, sharing no code with the trainer:

    gradient_noise_scale    = noise/trace_running / noise/g2_running      (both running means above 0)
    update_consistent_share = 1 / (1 + gradient_noise_scale / noise/update_samples)

and the same for the `_epoch` pair from noise/trace and noise/g2. A value the trainer could not estimate is None, and
then noise/reason must say why. Logs from before these fields were written have nothing to check (no check at all);
logs from before the share's rename carry it as update_signal_share, and are checked under that name.
"""

from __future__ import annotations

from recam.infra.schema import CONSISTENT_SHARE, CONSISTENT_SHARE_BEFORE, consistent_share_of
from recam.verify.core import FAIL, PASS, WARN, Check, _float, _short

# the recorded values are the very doubles the definitions divide, so they agree to rounding
REL_TOL = 1e-9


def _agrees(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def _share_key(r: dict, epoch: bool) -> str:
    """The name the record carries its consistent share under, to name it in a problem as the log spells it."""
    suffix = "_epoch" if epoch else ""
    return CONSISTENT_SHARE_BEFORE + suffix if CONSISTENT_SHARE + suffix not in r else CONSISTENT_SHARE + suffix


def _pair_problems(r: dict, scale_key: str, epoch: bool, g2_key: str, trace_key: str) -> list[str]:
    e = r.get("epoch")
    share_key = _share_key(r, epoch)
    b, share = _float(r.get(scale_key)), _float(consistent_share_of(r, epoch))
    g2, trace, B = _float(r.get(g2_key)), _float(r.get(trace_key)), _float(r.get("noise/update_samples"))
    if b is None:
        return [f"epoch {e}: {share_key} {share} without a {scale_key}"] if share is not None else []
    if g2 is None or trace is None or not (g2 > 0 and trace > 0):
        return [f"epoch {e}: {scale_key} {b:.6g} but {trace_key} {trace} / {g2_key} {g2} is not a positive ratio"]
    out = []
    if not _agrees(b, trace / g2):
        out.append(f"epoch {e}: {scale_key} {b:.6g} is not {trace_key} / {g2_key} = {trace / g2:.6g}")
    if B is None or B <= 0:
        out.append(f"epoch {e}: {scale_key} {b:.6g} without the update's samples (noise/update_samples {B})")
    elif share is None or not _agrees(share, 1 / (1 + b / B)):
        out.append(f"epoch {e}: {share_key} {share} is not 1 / (1 + {b:.6g} / {B:g}) = {1 / (1 + b / B):.6g}")
    return out


def check_noise_scale(epochs: list[dict]) -> list[Check]:
    """One whole-run check of every epoch record's noise scale fields (module docstring); [] when no record has
    them."""
    logged = [r for r in epochs if "gradient_noise_scale" in r]
    if not logged:
        return []
    problems, unexplained = [], []
    for r in logged:
        problems += _pair_problems(r, "gradient_noise_scale", False, "noise/g2_running", "noise/trace_running")
        problems += _pair_problems(r, "gradient_noise_scale_epoch", True, "noise/g2", "noise/trace")
        none = [k for k in ("gradient_noise_scale", "gradient_noise_scale_epoch") if r.get(k) is None]
        reason = r.get("noise/reason")
        if none and not (isinstance(reason, str) and reason):
            unexplained.append(f"epoch {r.get('epoch')}: {', '.join(none)} None without noise/reason")
    missing = [r.get("epoch") for r in epochs if "gradient_noise_scale" not in r]
    measured = [r for r in logged if _float(r.get("gradient_noise_scale")) is not None]
    nums = {"epochs_logged": len(logged), "epochs_measured": len(measured), "epochs_without_fields": len(missing)}
    if measured:
        last = measured[-1]
        nums.update(last_epoch=last.get("epoch"), noise_scale=last["gradient_noise_scale"],
                    update_samples=last.get("noise/update_samples"), consistent_share=consistent_share_of(last))
    if problems:
        return [Check("noise_scale", FAIL, nums, "noise scale fields disagree with their definitions: "
                      + _short(problems, 4))]
    if unexplained or missing:
        why = unexplained + ([f"no noise fields in epoch(s) {_short(missing, 6)}"] if missing else [])
        return [Check("noise_scale", WARN, nums, "; ".join(why))]
    if not measured:
        return [Check("noise_scale", PASS, nums,
                      f"not measured in any epoch, and said why: {logged[-1]['noise/reason']}")]
    return [Check("noise_scale", PASS, nums, f"every epoch's noise scale and consistent share follow from their "
                                             f"running means; last: {nums['noise_scale']:.4g} samples, updates of "
                                             f"{nums['update_samples']:g} samples {nums['consistent_share']:.3g} "
                                             "consistent (KL pull included)")]
