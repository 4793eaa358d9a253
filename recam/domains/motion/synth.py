"""Procedural text-to-motion clips on the HumanML3D skeleton: walk, run, jump, turn, side-step, squat, kick, wave...

Every clip is built by forward kinematics on the reference skeleton (so bone lengths are exact at every frame)
from a few time "channels": the root's path and facing, the pelvis height, trunk lean and twist, per-foot targets
(position of the foot joint on the floor or in the air, yaw and pitch) and per-arm directions.  Legs reach their
foot targets by two-bone IK; the pelvis is lowered where a planted foot would otherwise be out of reach, so planted
feet never slide (HumanML3D's contact features and foot-skating metrics are meaningful on these clips).

Locomotion is footstep-based: a gait phase (cycles; the left foot swings while phase mod 1 < 1 - duty, the right
one half a cycle later) decides stance and swing; each stance plants the foot where the body's nominal stance
places it at mid-stance; swings interpolate between plants with a lift.  The pelvis bobs twice per stride (highest
at mid-stance when walking, lowest when running), sways towards the stance foot and yaws with the stepping leg;
arms swing opposite to the legs.

Units: metres, seconds, radians inside; `MotionSpec` takes degrees for turns and headings, m/s for speeds.
Body frame: +z forward, +x the body's left, +y up.  A positive yaw turns the body to its left (counterclockwise
seen from above).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.interpolate import CubicHermiteSpline
from scipy.ndimage import gaussian_filter1d, minimum_filter1d

from recam.domains.motion import skeleton as sk
from recam.domains.motion.features import swing_matrices

FPS = sk.FPS
PAD = 60  # frames simulated before and after the clip, so that gait and smoothing have no edge effects
GRAVITY = 9.81

KINDS: tuple[str, ...] = (
    "walk", "run", "walk_backward", "sidestep", "turn", "jump", "squat", "kick", "wave", "raise_arms",
    "walk_then_turn", "walk_and_wave",
)
LOCOMOTION_KINDS = frozenset({"walk", "run", "walk_backward", "sidestep", "walk_then_turn", "walk_and_wave"})
# Which `side` values each kind accepts ("none" = the kind has no side).
KIND_SIDES: dict[str, tuple[str, ...]] = {
    "walk": ("none",), "run": ("none",), "walk_backward": ("none",), "jump": ("none",), "squat": ("none",),
    "sidestep": ("left", "right"), "turn": ("left", "right"), "kick": ("left", "right"), "wave": ("left", "right"),
    "raise_arms": ("left", "right", "both"), "walk_then_turn": ("left", "right"), "walk_and_wave": ("left", "right"),
}
# Speed ranges (m/s) per kind; for jumps `speed` is the horizontal speed in flight (0 = in place).
SPEED_RANGES: dict[str, tuple[float, float]] = {
    "walk": (0.6, 1.9), "walk_then_turn": (0.6, 1.9), "walk_and_wave": (0.6, 1.9),
    "run": (2.3, 3.9), "walk_backward": (0.4, 1.1), "sidestep": (0.3, 0.7), "jump": (0.0, 1.5),
}
# Speed words: (upper bound of "slow", lower bound of "fast") per kind family.
SPEED_WORD_BOUNDS: dict[str, tuple[float, float]] = {
    "walk": (0.95, 1.45), "run": (2.8, 3.4), "walk_backward": (0.6, 0.9), "sidestep": (0.4, 0.6),
}


@dataclass(frozen=True)
class MotionSpec:
    """Parameters of one synthetic clip; `make_motion(spec)` is a pure function of them.

    kind: one of KINDS.  speed: m/s (locomotion; jumps: horizontal speed in flight; others ignore it).
    side: left / right / both / none (see KIND_SIDES): turn direction, side-step direction, kicking leg, waving
    hand, raised arm.  turn_deg: turn magnitude (turn, walk_then_turn).  repetitions: jumps, squats, kicks, arm
    raises, hand waves (one wave = one side-to-side cycle).  num_frames: joint frames (the features get one
    fewer).  lead_frames: idle frames before a gesture starts.  heading_deg: world facing at the start
    (removed by canonicalisation; it only exercises it).  gait_phase: stride phase (cycles) at frame 0 of
    locomotion; 0 = the left foot lifts off.
    """

    kind: str
    num_frames: int = 120
    speed: float = 0.0
    side: str = "none"
    turn_deg: float = 0.0
    repetitions: int = 1
    lead_frames: int = 10
    heading_deg: float = 0.0
    gait_phase: float = 0.3

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown motion kind {self.kind!r}")
        if self.side not in KIND_SIDES[self.kind]:
            raise ValueError(f"{self.kind} takes side in {KIND_SIDES[self.kind]}, got {self.side!r}")
        if self.num_frames < 2:
            raise ValueError("num_frames must be >= 2")
        if self.repetitions < 1:
            raise ValueError("repetitions must be >= 1")
        if self.kind in ("turn", "walk_then_turn") and not self.turn_deg > 0:
            raise ValueError("turns need turn_deg > 0")


# ----------------------------------------------------------------------------------------------------------------
# Small pure helpers


def smoothstep(x):
    x = np.clip(x, 0.0, 1.0)
    return x * x * (3.0 - 2.0 * x)


def ramp(t, a: float, b: float):
    """0 before a, 1 after b, smooth (zero slope at both ends) in between."""
    return smoothstep((np.asarray(t) - a) / max(b - a, 1e-9))


def pulse(t, start: float, rise: float, hold: float, fall: float):
    """0 -> 1 over [start, start+rise], held for `hold`, back to 0 over `fall`."""
    t1 = start + rise
    t2 = t1 + hold
    return ramp(t, start, t1) * (1.0 - ramp(t, t2, t2 + fall))


def hermite(t, keys):
    """Piecewise-cubic curve through keyframes (time, value, slope); constant outside them.

    Keys at the same time (one movement ending where the next begins) are kept once, the first given."""
    seen: dict[float, tuple] = {}
    for k in keys:
        seen.setdefault(round(float(k[0]), 9), k)
    keys = sorted(seen.values())
    ts = np.array([k[0] for k in keys])
    vs = np.array([k[1] for k in keys], dtype=np.float64)
    ds = np.array([k[2] for k in keys], dtype=np.float64)
    out = CubicHermiteSpline(ts, vs, ds)(np.clip(t, ts[0], ts[-1]))
    return out


def arm_direction(abduction, flexion, sign: float) -> np.ndarray:
    """Unit direction(s) (..., 3) in the torso frame of an arm segment hanging down, flexed forward by `flexion`
    then abducted sideways by `abduction` (radians); sign +1 for the left arm, -1 for the right."""
    flexion = np.asarray(flexion, dtype=np.float64)
    abduction = np.asarray(abduction, dtype=np.float64)
    down = np.array([0.0, -1.0, 0.0])
    v = np.einsum("...ij,j->...i", sk.rot_x(-flexion), down)
    return np.einsum("...ij,...j->...i", sk.rot_z(sign * abduction), v)


def yaw_matrix_apply(yaw, v2):
    """Rotate body-frame horizontal vectors (..., 2) = (x, z) by yaw into world (x, z)."""
    c, s = np.cos(yaw), np.sin(yaw)
    return np.stack([c * v2[..., 0] + s * v2[..., 1], -s * v2[..., 0] + c * v2[..., 1]], axis=-1)


def side_sign(side: str) -> float:
    return {"left": 1.0, "right": -1.0}.get(side, 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Channels: everything a clip is made of, on the padded time grid


REST = sk.rest_pose()
STAND_HEIGHT = float(REST[0, 1]) - 0.015  # knees a little soft, never locked at the reach limit
# Body-frame (x, z) of the foot joints when standing, relative to the pelvis: the rest pose's, made left/right
# symmetric so that mirrored specs place their feet as mirror images (the legs' lengths differ by 1 cm; IK absorbs it).
_rest_feet = REST[[sk.LEFT_FOOT, sk.RIGHT_FOOT]][:, [0, 2]] - REST[0, [0, 2]]
NOMINAL_FEET = np.array([[1.0, 1.0], [-1.0, 1.0]]) * np.abs(_rest_feet).mean(axis=0)
FOOT_JOINT = (sk.LEFT_FOOT, sk.RIGHT_FOOT)
ANKLE_JOINT = (sk.LEFT_ANKLE, sk.RIGHT_ANKLE)
HIP_JOINT = (1, 2)
KNEE_JOINT = (4, 5)
SHOULDER_JOINT = (16, 17)
ELBOW_JOINT = (18, 19)
WRIST_JOINT = (20, 21)
ARM_NEUTRAL = {"abd": math.radians(8.0), "flex": 0.0, "fore_abd": math.radians(4.0), "fore_flex": math.radians(10.0)}


@dataclass
class Channels:
    t: np.ndarray  # (N,) seconds; clip frame 0 is t = 0
    root_xz: np.ndarray  # (N, 2) pelvis path before sway/shift
    yaw: np.ndarray  # (N,) body facing (unwrapped)
    height: np.ndarray  # (N,) desired pelvis height (lowered where feet demand)
    sway: np.ndarray  # (N,) pelvis offset along the body's x (left)
    shift: np.ndarray  # (N,) pelvis offset along the body's z (forward)
    pelvis_yaw: np.ndarray  # (N,) pelvis yaw relative to `yaw`
    pelvis_pitch: np.ndarray  # (N,) forward tilt of the pelvis
    pelvis_roll: np.ndarray  # (N,)
    lean: np.ndarray  # (N,) forward lean of the spine above the pelvis
    twist: np.ndarray  # (N,) spine yaw relative to the pelvis
    foot_pos: np.ndarray  # (2, N, 3) foot joint targets (left, right)
    foot_yaw: np.ndarray  # (2, N)
    foot_pitch: np.ndarray  # (2, N) toe down positive
    stance: np.ndarray  # (2, N) bool: planted (these constrain the pelvis height)
    arm_abd: np.ndarray  # (2, N) upper arm abduction (left, right)
    arm_flex: np.ndarray  # (2, N)
    fore_abd: np.ndarray  # (2, N)
    fore_flex: np.ndarray  # (2, N)


def standing_channels(num_frames: int) -> Channels:
    n = num_frames + 2 * PAD
    t = (np.arange(n) - PAD) / FPS
    z = np.zeros(n)
    feet = np.zeros((2, n, 3))
    for i in range(2):
        feet[i, :, 0] = NOMINAL_FEET[i, 0]
        feet[i, :, 2] = NOMINAL_FEET[i, 1]
    return Channels(
        t=t, root_xz=np.zeros((n, 2)), yaw=z.copy(), height=np.full(n, STAND_HEIGHT), sway=z.copy(),
        shift=z.copy(), pelvis_yaw=z.copy(), pelvis_pitch=z.copy(), pelvis_roll=z.copy(), lean=z.copy(),
        twist=z.copy(), foot_pos=feet, foot_yaw=np.zeros((2, n)), foot_pitch=np.zeros((2, n)),
        stance=np.ones((2, n), dtype=bool),
        arm_abd=np.full((2, n), ARM_NEUTRAL["abd"]), arm_flex=np.full((2, n), ARM_NEUTRAL["flex"]),
        fore_abd=np.full((2, n), ARM_NEUTRAL["fore_abd"]), fore_flex=np.full((2, n), ARM_NEUTRAL["fore_flex"]),
    )


# ----------------------------------------------------------------------------------------------------------------
# Gait: phase -> stance, plants, swings


@dataclass(frozen=True)
class Gait:
    duty: float  # stance fraction of a cycle per foot
    clearance: float  # swing lift of the foot joint (m)
    bob: float  # pelvis bob amplitude (m); positive = highest at mid-stance (walking), negative (running)
    sway: float  # lateral pelvis sway towards the stance foot (m)
    arm_swing: float  # shoulder flexion amplitude (rad)
    elbow: float  # extra elbow flexion while moving (rad)
    pelvis_yaw: float  # pelvis yaw amplitude (rad)
    lean: float  # trunk lean while moving (rad)
    heel_off: float = 0.45  # foot pitch at toe-off: the heel rises about the planted foot joint in late stance
    toe_up: float = 0.2  # toe raised before landing


WALK = Gait(duty=0.6, clearance=0.1, bob=0.022, sway=0.022, arm_swing=0.3, elbow=0.25, pelvis_yaw=0.08, lean=0.05)
RUN = Gait(duty=0.38, clearance=0.2, bob=-0.03, sway=0.012, arm_swing=0.55, elbow=1.3, pelvis_yaw=0.1, lean=0.16,
           heel_off=0.6)
BACKWARD = Gait(duty=0.62, clearance=0.1, bob=0.015, sway=0.02, arm_swing=0.15, elbow=0.2, pelvis_yaw=0.05,
                lean=-0.04)
SIDESTEP = Gait(duty=0.6, clearance=0.09, bob=0.012, sway=0.035, arm_swing=0.0, elbow=0.1, pelvis_yaw=0.0, lean=0.02,
                heel_off=0.15, toe_up=0.05)
TURN_STEPS = Gait(duty=0.62, clearance=0.07, bob=0.008, sway=0.015, arm_swing=0.0, elbow=0.1, pelvis_yaw=0.0,
                  lean=0.0, heel_off=0.1, toe_up=0.05)


def stop_phase(duty: float) -> float:
    """A phase (mod 0.5) in the middle of double support, where a gait can start or stop with both feet down."""
    return (1.5 - duty) / 2.0 % 0.5


def cadence(kind: str, speed: float) -> float:
    """Gait cycles per second (two steps per cycle)."""
    if kind == "run":
        return 0.5 * 2.7 * (speed / 3.0) ** 0.3
    if kind == "walk_backward":
        return 0.5 * 1.7 * (max(speed, 0.2) / 0.8) ** 0.35
    if kind == "sidestep":
        return 0.5 * 1.9
    return 0.5 * 1.8 * (max(speed, 0.2) / 1.3) ** 0.45


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of True in a 1-D boolean array."""
    padded = np.concatenate([[False], mask, [False]])
    edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
    return list(zip(edges[0::2], edges[1::2], strict=True))


def apply_gait(ch: Channels, phase: np.ndarray, gait: Gait, weight: np.ndarray, forward_sign: float = 1.0,
               first_frame: int = 0) -> None:
    """Footsteps from a gait phase, plus the pelvis, trunk and arm motion of walking, scaled by `weight`.

    Where the phase stands still in double support both feet stay planted; the phase must only stop there.
    Feet before `first_frame` are left as they are, and a stance that began before it keeps its plant.
    """
    duty = gait.duty
    swing_len = 1.0 - duty
    for i, offset in enumerate((0.0, 0.5)):
        u = np.mod(phase - offset, 1.0)
        stance = u >= swing_len
        pos, fyaw, pitch = ch.foot_pos[i], ch.foot_yaw[i], ch.foot_pitch[i]
        plants = {}
        for a, b in _runs(stance):
            if a < first_frame <= b - 1 or (a < first_frame and b == first_frame):
                xz, yw = pos[first_frame - 1, [0, 2]].copy(), fyaw[first_frame - 1]
            else:
                m = (a + b - 1) // 2
                xz, yw = ch.root_xz[m] + yaw_matrix_apply(ch.yaw[m], NOMINAL_FEET[i]), ch.yaw[m]
            plants[(a, b)] = (xz, yw)
        for (a, b), (xz, yw) in plants.items():
            a = max(a, first_frame)
            pos[a:b, 0], pos[a:b, 1], pos[a:b, 2] = xz[0], 0.0, xz[1]
            q = (u[a:b] - swing_len) / duty
            fyaw[a:b] = yw
            pitch[a:b] = weight[a:b] * gait.heel_off * smoothstep((q - 0.55) / 0.45)
        ends = {b: v for (a, b), v in plants.items()}
        starts = {a: v for (a, b), v in plants.items()}
        for a, b in _runs(~stance):
            if b <= first_frame:
                continue
            src = ends.get(a, starts.get(b))
            dst = starts.get(b, src)
            if src is None:
                continue
            s = np.clip(u[a:b] / swing_len, 0.0, 1.0)
            # Lift fast, travel mostly while lifted, come down fast: a foot low over the floor is not sliding.
            e = smoothstep(smoothstep(s))
            lo = max(a, first_frame)
            sl = slice(lo - a, b - a)
            pos[lo:b, 0] = src[0][0] + (dst[0][0] - src[0][0]) * e[sl]
            pos[lo:b, 2] = src[0][1] + (dst[0][1] - src[0][1]) * e[sl]
            pos[lo:b, 1] = gait.clearance * np.sin(np.pi * s[sl]) ** 0.6
            fyaw[lo:b] = src[1] + (dst[1] - src[1]) * e[sl]
            ss = s[sl]
            pitch[lo:b] = weight[lo:b] * (gait.heel_off * (1.0 - smoothstep(ss / 0.45))
                                          - gait.toe_up * np.sin(np.pi * ss) ** 2 * smoothstep((ss - 0.2) / 0.5))
        ch.stance[i, first_frame:] = stance[first_frame:]

    left_touchdown = swing_len  # left leg furthest forward
    leg = np.cos(2.0 * np.pi * (phase - left_touchdown)) * forward_sign
    mid_right = (1.5 - duty / 2.0) % 1.0
    mid_left = 1.0 - duty / 2.0
    ch.height = ch.height + weight * gait.bob * np.cos(4.0 * np.pi * (phase - mid_right))
    ch.sway = ch.sway + weight * gait.sway * np.cos(2.0 * np.pi * (phase - mid_left))
    ch.pelvis_yaw = ch.pelvis_yaw - weight * gait.pelvis_yaw * leg
    ch.twist = ch.twist + weight * 0.8 * gait.pelvis_yaw * leg
    ch.pelvis_roll = ch.pelvis_roll + weight * 0.03 * np.cos(2.0 * np.pi * (phase - mid_left))
    ch.lean = ch.lean + weight * gait.lean
    for i, sgn in ((0, -1.0), (1, 1.0)):
        delta = sgn * weight * gait.arm_swing * leg
        ch.arm_flex[i] = ch.arm_flex[i] + delta
        # The elbow bends more as the arm swings forward.
        ch.fore_flex[i] = ch.fore_flex[i] + delta + weight * gait.elbow + 0.5 * np.maximum(delta, 0.0)
    if gait.elbow > 0.8:  # running: forearms cross slightly in front of the body
        ch.fore_abd = ch.fore_abd - weight[None] * 0.25


def locomotion_path(ch: Channels, velocity_body: np.ndarray) -> None:
    """Integrate a body-frame velocity (N, 2) (x = left, z = forward; m/s) along the yaw into the root path."""
    world = yaw_matrix_apply(ch.yaw, velocity_body) / FPS
    path = np.cumsum(world, axis=0)
    ch.root_xz = path - path[PAD]


def steady_gait(ch: Channels, kind: str, speed: float, gait: Gait, direction_body: tuple[float, float],
                phase0: float) -> np.ndarray:
    """Constant-speed stepping over the whole padded grid (clips cut out of an ongoing walk); returns the phase."""
    n = len(ch.t)
    vel = np.tile(np.asarray(direction_body, dtype=np.float64) * speed, (n, 1))
    locomotion_path(ch, vel)
    phase = phase0 + cadence(kind, speed) * ch.t
    forward_sign = -1.0 if direction_body[1] < 0 else (1.0 if direction_body[1] > 0 else 0.0)
    apply_gait(ch, phase, gait, np.ones(n), forward_sign)
    return phase


def add_turn_in_place(ch: Channels, start: float, angle: float, phase_before: float) -> float:
    """Step around on the spot, turning by `angle` (rad, + = left) from time `start`; returns its end time.

    The foot on the side of the turn steps first.  The phase before must be a double-support one.
    """
    duration = max(1.0, abs(angle) / math.radians(110.0))
    steps = max(2, int(math.ceil(abs(angle) / math.radians(55.0))))
    steps += steps % 2  # an even number of steps: each foot turns as often and both end side by side
    sp = stop_phase(TURN_STEPS.duty)
    # Left foot first: start at sp + 0.5 (mod 1), the left foot swings from phase 1.0; right first: sp.
    base = math.floor(phase_before) + (sp + 0.5 if angle > 0 else sp)
    rate = 0.5 * steps / duration
    t = ch.t
    phase = base + rate * np.clip(t - start, 0.0, duration)
    ch.yaw = ch.yaw + angle * ramp(t, start, start + duration)
    weight = pulse(t, start, 0.15 * duration, 0.7 * duration, 0.15 * duration)
    # Only the part of the grid from `start` on is re-stepped; earlier feet are kept as they are.
    apply_gait(ch, phase, TURN_STEPS, weight, 1.0, first_frame=int(np.searchsorted(t, start)))
    return start + duration


def turn_frames(turn_deg: float) -> int:
    return int(math.ceil(max(1.0, turn_deg / 110.0) * FPS))


# ----------------------------------------------------------------------------------------------------------------
# Arm gestures (overlays on the arm channels)


def add_wave(ch: Channels, arm: int, start: float, waves: int, freq: float = 2.2) -> float:
    """Raise the arm to the side with the forearm up, wave it side to side `waves` times, lower it."""
    up, down = 0.55, 0.55
    hold = waves / freq
    w = pulse(ch.t, start, up, hold, down)
    osc_t = np.clip(ch.t - (start + up), 0.0, hold)
    osc = math.radians(25.0) * np.sin(2.0 * np.pi * freq * osc_t)
    target = {"abd": math.radians(95.0), "flex": math.radians(25.0), "fore_abd": math.radians(172.0) + osc,
              "fore_flex": math.radians(15.0)}
    _blend_arm(ch, arm, w, target)
    return start + up + hold + down


def add_raise(ch: Channels, arm: int, start: float, reps: int, up: float = 0.8, hold: float = 0.6,
              down: float = 0.8, gap: float = 0.3) -> float:
    """Raise the arm forward and up above the head, hold, lower; `reps` times."""
    t0 = start
    w = np.zeros_like(ch.t)
    for _ in range(reps):
        w = np.maximum(w, pulse(ch.t, t0, up, hold, down))
        t0 += up + hold + down + gap
    target = {"abd": math.radians(12.0), "flex": math.radians(165.0), "fore_abd": math.radians(8.0),
              "fore_flex": math.radians(172.0)}
    _blend_arm(ch, arm, w, target)
    return t0 - gap


def _blend_arm(ch: Channels, arm: int, w: np.ndarray, target: dict) -> None:
    ch.arm_abd[arm] = ch.arm_abd[arm] * (1 - w) + w * target["abd"]
    ch.arm_flex[arm] = ch.arm_flex[arm] * (1 - w) + w * target["flex"]
    ch.fore_abd[arm] = ch.fore_abd[arm] * (1 - w) + w * target["fore_abd"]
    ch.fore_flex[arm] = ch.fore_flex[arm] * (1 - w) + w * target["fore_flex"]


# ----------------------------------------------------------------------------------------------------------------
# Motions


def wave_frames(waves: int) -> int:
    return int(math.ceil((1.1 + waves / 2.2) * FPS))


def raise_frames(reps: int) -> int:
    return int(math.ceil((reps * 2.5 - 0.3) * FPS))


SQUAT_PERIOD = 2.0
KICK_PERIOD = 1.25
KICK_SHIFT = 0.4  # weight shift onto the standing leg before and after the kicks
JUMP_PHASES = {"crouch": 0.45, "push": 0.15, "flight": 0.4, "absorb": 0.3, "rise": 0.4}


def jump_period() -> float:
    return sum(JUMP_PHASES.values())


def action_frames(spec: MotionSpec) -> int:
    """Frames a gesture / jump / turn needs after its lead (locomotion fills any length: 0)."""
    k, r = spec.kind, spec.repetitions
    if k == "wave":
        return wave_frames(r)
    if k == "raise_arms":
        return raise_frames(r)
    if k == "squat":
        return int(math.ceil(r * SQUAT_PERIOD * FPS))
    if k == "kick":
        return int(math.ceil((r * KICK_PERIOD + 2 * KICK_SHIFT) * FPS))
    if k == "jump":
        return int(math.ceil(r * jump_period() * FPS))
    if k == "turn":
        return turn_frames(spec.turn_deg)
    if k == "walk_then_turn":
        return 40 + 20 + turn_frames(spec.turn_deg)  # >= 2 s of walking, stopping, the turn and 0.5 s
    if k == "walk_and_wave":
        return wave_frames(r)
    return 0


def min_frames(spec: MotionSpec, tail: int = 6) -> int:
    """Shortest clip that shows all of the spec (gestures need their lead, action and a short tail)."""
    a = action_frames(spec)
    return max(2, spec.lead_frames + a + tail) if a else 2


def _walk_like(spec: MotionSpec, ch: Channels) -> np.ndarray:
    table = {
        "walk": (WALK, (0.0, 1.0)), "walk_then_turn": (WALK, (0.0, 1.0)), "walk_and_wave": (WALK, (0.0, 1.0)),
        "run": (RUN, (0.0, 1.0)), "walk_backward": (BACKWARD, (0.0, -1.0)),
        "sidestep": (SIDESTEP, (side_sign(spec.side), 0.0)),
    }
    gait, direction = table[spec.kind]
    # Side-stepping to the right is the mirror image of stepping left: the right foot leads where the left one did.
    phase0 = spec.gait_phase + (0.5 if spec.kind == "sidestep" and spec.side == "right" else 0.0)
    return steady_gait(ch, spec.kind if spec.kind in ("run", "walk_backward", "sidestep") else "walk", spec.speed,
                       gait, direction, phase0)


def _build_walk_then_turn(spec: MotionSpec, ch: Channels) -> None:
    t = ch.t
    T = spec.num_frames / FPS
    c = cadence("walk", spec.speed)
    turn_start = T - turn_frames(spec.turn_deg) / FPS - 0.5
    # The body comes to rest, then the feet close within half a cycle, then the turn begins.
    decel_end = turn_start - 0.15 - 0.5 / c
    decel_start = decel_end - 0.6
    speed = spec.speed * (1.0 - ramp(t, decel_start, decel_end))
    locomotion_path(ch, np.stack([np.zeros_like(t), speed], axis=-1))
    free = spec.gait_phase + c * t
    sp = stop_phase(WALK.duty)
    p_end = free[int(np.searchsorted(t, decel_end))]
    p_stop = math.floor((p_end - sp) / 0.5 + 1.0) * 0.5 + sp
    phase = np.minimum(free, p_stop)
    weight = 1.0 - ramp(t, decel_start, decel_end + 0.3)
    apply_gait(ch, phase, WALK, weight, 1.0)
    add_turn_in_place(ch, turn_start, side_sign(spec.side) * math.radians(spec.turn_deg), p_stop)


def _build_turn(spec: MotionSpec, ch: Channels) -> None:
    sp = stop_phase(TURN_STEPS.duty)
    add_turn_in_place(ch, spec.lead_frames / FPS, side_sign(spec.side) * math.radians(spec.turn_deg), sp)


def _build_squat(spec: MotionSpec, ch: Channels) -> None:
    t = ch.t
    start = spec.lead_frames / FPS
    depth = np.zeros_like(t)
    for k in range(spec.repetitions):
        t0 = start + k * SQUAT_PERIOD
        depth = np.maximum(depth, pulse(t, t0, 0.85, 0.2, 0.85))
    ch.height = ch.height - 0.42 * depth
    ch.shift = ch.shift - 0.13 * depth
    ch.pelvis_pitch = ch.pelvis_pitch + 0.35 * depth
    ch.lean = ch.lean + 0.3 * depth
    for arm in (0, 1):
        _blend_arm(ch, arm, depth, {"abd": math.radians(10.0), "flex": math.radians(80.0),
                                    "fore_abd": math.radians(5.0), "fore_flex": math.radians(85.0)})


def _build_kick(spec: MotionSpec, ch: Channels) -> None:
    t = ch.t
    leg = 0 if spec.side == "left" else 1
    stand = 1 - leg
    start = spec.lead_frames / FPS
    end = start + KICK_SHIFT + spec.repetitions * KICK_PERIOD
    shift_w = pulse(t, start, KICK_SHIFT, end - start - 2 * KICK_SHIFT, KICK_SHIFT)
    # Weight onto the standing leg: sway towards it (body x of its foot), lean the trunk back a little.
    ch.sway = ch.sway + shift_w * 0.6 * NOMINAL_FEET[stand, 0]
    ch.pelvis_roll = ch.pelvis_roll + shift_w * 0.05 * (1.0 if stand == 0 else -1.0)
    ch.arm_abd = ch.arm_abd + shift_w[None] * math.radians(20.0)
    kick_dur = 0.85
    pos = ch.foot_pos[leg]
    for k in range(spec.repetitions):
        t0 = start + KICK_SHIFT + k * KICK_PERIOD + 0.5 * (KICK_PERIOD - kick_dur)
        s = np.clip((t - t0) / kick_dur, 0.0, 1.0)
        active = (s > 0) & (s < 1)
        lift = np.sin(np.pi * s) ** 2
        reach = np.sin(np.pi * s) ** 4
        pos[:, 1] += 0.55 * lift
        pos[:, 2] += 0.55 * reach
        ch.foot_pitch[leg] += 0.9 * reach
        ch.stance[leg] &= ~active
        ch.lean = ch.lean - 0.18 * reach
        ch.pelvis_pitch = ch.pelvis_pitch - 0.1 * reach


def _build_jump(spec: MotionSpec, ch: Channels) -> None:
    t = ch.t
    p = JUMP_PHASES
    tf = p["flight"]
    v0 = GRAVITY * tf / 2.0
    crouch = 0.16
    h0 = STAND_HEIGHT
    h_to = h0 + 0.03  # leaves the ground on its toes
    hkeys = [(-10.0, h0, 0.0)]
    fkeys = [(-10.0, 0.0, 0.0)]
    akeys = [(-10.0, ARM_NEUTRAL["flex"], 0.0)]
    xkeys = [(-10.0, 0.0, 0.0)]
    flights = []
    t0 = spec.lead_frames / FPS
    dist = spec.speed * tf
    x = 0.0
    for _ in range(spec.repetitions):
        t_low = t0 + p["crouch"]
        t_to = t_low + p["push"]
        t_land = t_to + tf
        t_abs = t_land + p["absorb"]
        t_up = t_abs + p["rise"]
        hkeys += [(t0, h0, 0.0), (t_low, h0 - crouch, 0.0), (t_to, h_to, v0), (t_land, h_to, -v0),
                  (t_abs, h0 - 0.7 * crouch, 0.0), (t_up, h0, 0.0)]
        fkeys += [(t0, 0.0, 0.0), (t_low, 0.1, 0.0), (t_to, 0.55, 0.0), (t_land, 0.35, 0.0), (t_abs, 0.0, 0.0)]
        akeys += [(t0, 0.0, 0.0), (t_low, -0.7, 0.0), (t_to, 1.9, 4.0), (t_land, 1.2, -3.0), (t_up, 0.0, 0.0)]
        vx = dist / tf
        xkeys += [(t_low, x, 0.0), (t_to, x + 0.04 * spec.speed, vx), (t_land, x + 0.04 * spec.speed + dist, vx),
                  (t_abs, x + 0.08 * spec.speed + dist, 0.0)]
        x += 0.08 * spec.speed + dist
        flights.append((t_to, t_land))
        t0 = t_up
    end = t0 + 10.0
    hkeys.append((end, h0, 0.0))
    fkeys.append((end, 0.0, 0.0))
    akeys.append((end, 0.0, 0.0))
    xkeys.append((end, x, 0.0))
    ch.height = hermite(t, hkeys)
    forward = hermite(t, xkeys)
    ch.root_xz = np.stack([np.zeros_like(t), forward], axis=-1)
    pitch = hermite(t, fkeys)
    arm = hermite(t, akeys)
    for a in (0, 1):
        ch.arm_flex[a] = arm
        ch.fore_flex[a] = arm + 0.3
    airborne = np.zeros_like(t, dtype=bool)
    for t_to, t_land in flights:
        airborne |= (t > t_to) & (t < t_land)
    for i in (0, 1):
        # Feet on the ground stay where they landed; in the air they follow the pelvis, knees tucked a little.
        runs = _runs(~airborne)
        pos = ch.foot_pos[i]
        for a, b in runs:
            m = (a + b - 1) // 2
            pos[a:b, 0] = NOMINAL_FEET[i, 0]
            pos[a:b, 2] = forward[m] + NOMINAL_FEET[i, 1]
            pos[a:b, 1] = 0.0
        for (_, b0), (a1, _) in zip(runs[:-1], runs[1:], strict=True):
            s = np.clip((t[b0:a1] - t[b0 - 1]) / (t[a1] - t[b0 - 1]), 0.0, 1.0)
            pos[b0:a1, 2] = pos[b0 - 1, 2] + (pos[a1, 2] - pos[b0 - 1, 2]) * smoothstep(s)
            pos[b0:a1, 1] = ch.height[b0:a1] - h_to + 0.06 * np.sin(np.pi * s)
            pos[b0:a1, 1] = np.maximum(pos[b0:a1, 1], 0.0)
        ch.foot_pitch[i] = pitch
        ch.stance[i] = ~airborne
    ch.lean = ch.lean + 0.25 * (h0 - np.minimum(ch.height, h0)) / crouch


def _build_gesture_walk(spec: MotionSpec, ch: Channels) -> None:
    _walk_like(spec, ch)
    arm = 0 if spec.side == "left" else 1
    add_wave(ch, arm, spec.lead_frames / FPS, spec.repetitions)


# ----------------------------------------------------------------------------------------------------------------
# Solving channels into local rotations and joints


def _leg_ik(hip, ankle, l1, l2, hint, rest_thigh, rest_shank):
    """Global thigh and shank rotations (N, 3, 3) putting the ankle at `ankle` (or as close as the leg reaches),
    the knee bending towards `hint`."""
    d = ankle - hip
    dist = np.linalg.norm(d, axis=-1)
    dhat = d / dist[:, None]
    dist = np.clip(dist, abs(l1 - l2) + 1e-6, (l1 + l2) * (1.0 - 1e-9))
    cos_a = np.clip((l1**2 + dist**2 - l2**2) / (2 * l1 * dist), -1.0, 1.0)
    sin_a = np.sqrt(1.0 - cos_a**2)
    n = hint - np.sum(hint * dhat, axis=-1, keepdims=True) * dhat
    n /= np.linalg.norm(n, axis=-1, keepdims=True)
    knee = hip + l1 * (cos_a[:, None] * dhat + sin_a[:, None] * n)
    reached = hip + dist[:, None] * dhat
    thigh = (knee - hip) / l1
    shank = (reached - knee) / np.linalg.norm(reached - knee, axis=-1, keepdims=True)
    return swing_matrices(rest_thigh, thigh), swing_matrices(rest_shank, shank)


def solve(ch: Channels, bone_lengths: np.ndarray = sk.BONE_LENGTHS) -> tuple[np.ndarray, np.ndarray]:
    """Local rotations (N, 22, 3, 3) and root positions (N, 3) realising the channels."""
    offsets = sk.REST_DIRECTIONS * np.asarray(bone_lengths)[:, None]
    offsets[0] = 0.0
    n = len(ch.t)
    pelvis = sk.rot_y(ch.yaw + ch.pelvis_yaw) @ sk.rot_x(ch.pelvis_pitch) @ sk.rot_z(ch.pelvis_roll)
    root_xz = ch.root_xz + yaw_matrix_apply(ch.yaw, np.stack([ch.sway, ch.shift], axis=-1))

    foot_rot = [sk.rot_y(ch.foot_yaw[i]) @ sk.rot_x(ch.foot_pitch[i]) for i in range(2)]
    ankle = [ch.foot_pos[i] - np.einsum("nij,j->ni", foot_rot[i], offsets[FOOT_JOINT[i]]) for i in range(2)]
    hip_rel = [np.einsum("nij,j->ni", pelvis, offsets[HIP_JOINT[i]]) for i in range(2)]
    leg_len = [np.linalg.norm(offsets[KNEE_JOINT[i]]) + np.linalg.norm(offsets[ANKLE_JOINT[i]]) for i in range(2)]

    # Pelvis no higher than planted feet allow: a min filter then a Gaussian of the same radius stays below the
    # per-frame limit, and a soft minimum with the wanted height stays below both.
    limit = np.full(n, np.inf)
    for i in range(2):
        reach = 0.995 * leg_len[i]
        dxz = np.linalg.norm(ankle[i][:, [0, 2]] - (root_xz + hip_rel[i][:, [0, 2]]), axis=-1)
        up = np.sqrt(np.maximum(reach**2 - dxz**2, 0.0))
        lim = ankle[i][:, 1] - hip_rel[i][:, 1] + up
        limit = np.where(ch.stance[i], np.minimum(limit, lim), limit)
    limit = np.minimum(limit, ch.height + 1.0)
    radius = 6
    limit = gaussian_filter1d(minimum_filter1d(limit, 2 * radius + 1, mode="nearest"), radius / 4.0, mode="nearest",
                              truncate=4.0)
    tau = 0.008
    lo = np.minimum(ch.height, limit)
    height = lo - tau * np.log(np.exp(-(ch.height - lo) / tau) + np.exp(-(limit - lo) / tau))
    root = np.stack([root_xz[:, 0], height, root_xz[:, 1]], axis=-1)

    glob = np.zeros((n, sk.NUM_JOINTS, 3, 3))
    glob[:, 0] = pelvis
    fwd = np.einsum("nij,j->ni", pelvis, np.array([0.0, 0.0, 1.0]))
    for i in range(2):
        hip = root + hip_rel[i]
        foot_fwd = np.einsum("nij,j->ni", sk.rot_y(ch.foot_yaw[i]), np.array([0.0, 0.0, 1.0]))
        hint = foot_fwd + fwd + np.array([0.0, 0.5, 0.0])
        kj, aj = KNEE_JOINT[i], ANKLE_JOINT[i]
        g_thigh, g_shank = _leg_ik(hip, ankle[i], np.linalg.norm(offsets[kj]), np.linalg.norm(offsets[aj]), hint,
                                   sk.REST_DIRECTIONS[kj], sk.REST_DIRECTIONS[aj])
        glob[:, HIP_JOINT[i]] = g_thigh
        glob[:, kj] = g_shank
        glob[:, aj] = foot_rot[i]
        glob[:, FOOT_JOINT[i]] = foot_rot[i]

    lean, twist = ch.lean, ch.twist
    spine_local = {3: (0.35, 0.35), 6: (0.35, 0.35), 9: (0.3, 0.3)}
    for j, (fl, ft) in spine_local.items():
        glob[:, j] = glob[:, sk.PARENTS[j]] @ sk.rot_x(fl * lean) @ sk.rot_y(ft * twist)
    glob[:, 12] = glob[:, 9] @ sk.rot_x(-0.6 * (lean + ch.pelvis_pitch))
    glob[:, 15] = glob[:, 12]
    glob[:, 13] = glob[:, 9]
    glob[:, 14] = glob[:, 9]
    for i, sign in ((0, 1.0), (1, -1.0)):
        upper = arm_direction(ch.arm_abd[i], ch.arm_flex[i], sign)
        fore = arm_direction(ch.fore_abd[i], ch.fore_flex[i], sign)
        sj, ej, wj = SHOULDER_JOINT[i], ELBOW_JOINT[i], WRIST_JOINT[i]
        glob[:, sj] = glob[:, 9] @ swing_matrices(sk.REST_DIRECTIONS[ej], upper)
        glob[:, ej] = glob[:, 9] @ swing_matrices(sk.REST_DIRECTIONS[wj], fore)
        glob[:, wj] = glob[:, ej]

    local = np.empty_like(glob)
    local[:, 0] = glob[:, 0]
    parents = sk.PARENTS[1:]
    local[:, 1:] = np.swapaxes(glob[:, parents], -1, -2) @ glob[:, 1:]
    return local, root


_BUILDERS = {
    "turn": _build_turn, "squat": _build_squat, "kick": _build_kick, "jump": _build_jump,
    "walk_then_turn": _build_walk_then_turn, "walk_and_wave": _build_gesture_walk,
}


def build_channels(spec: MotionSpec) -> Channels:
    ch = standing_channels(spec.num_frames)
    k = spec.kind
    if k in _BUILDERS:
        _BUILDERS[k](spec, ch)
    elif k in ("walk", "run", "walk_backward", "sidestep"):
        _walk_like(spec, ch)
    elif k == "wave":
        add_wave(ch, 0 if spec.side == "left" else 1, spec.lead_frames / FPS, spec.repetitions)
    elif k == "raise_arms":
        arms = {"left": (0,), "right": (1,), "both": (0, 1)}[spec.side]
        for a in arms:
            add_raise(ch, a, spec.lead_frames / FPS, spec.repetitions)
    return ch


def synthesize(spec: MotionSpec, bone_lengths: np.ndarray = sk.BONE_LENGTHS) -> tuple[np.ndarray, np.ndarray]:
    """(joints (T, 22, 3), local rotations (T, 22, 3, 3)) of the spec in world coordinates (y up, floor at 0).

    `bone_lengths` (22,) defaults to HumanML3D's reference skeleton; a left/right symmetric one makes mirrored
    specs mirror images exactly.
    """
    ch = build_channels(spec)
    local, root = solve(ch, bone_lengths)
    clip = slice(PAD, PAD + spec.num_frames)
    local, root = local[clip], root[clip]
    heading = sk.rot_y(math.radians(spec.heading_deg))
    local[:, 0] = heading @ local[:, 0]
    root = root @ heading.T
    offsets = sk.REST_DIRECTIONS * np.asarray(bone_lengths)[:, None]
    offsets[0] = 0.0
    joints = sk.forward_kinematics(local, root, offsets)
    return joints, local


def make_motion(spec: MotionSpec) -> np.ndarray:
    """World joints (T, 22, 3) of a spec, T = spec.num_frames, 20 fps."""
    return synthesize(spec)[0]


# ----------------------------------------------------------------------------------------------------------------
# Captions

SUBJECTS: tuple[str, ...] = ("a person", "someone", "a man", "a woman", "the person", "a figure")
_COUNT = {1: "once", 2: "twice", 3: "three times", 4: "four times", 5: "five times", 6: "six times"}
_NUMBER = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def speed_class(spec: MotionSpec) -> str:
    """'slow', 'normal' or 'fast' for locomotion (the words captions use); 'none' for other kinds."""
    family = {"walk_then_turn": "walk", "walk_and_wave": "walk"}.get(spec.kind, spec.kind)
    if family not in SPEED_WORD_BOUNDS:
        return "none"
    slow, fast = SPEED_WORD_BOUNDS[family]
    return "slow" if spec.speed < slow else ("fast" if spec.speed >= fast else "normal")


def _adverbs(speed: str) -> list[str]:
    return {"slow": ["slowly", "at a slow pace", "leisurely"],
            "fast": ["quickly", "briskly", "fast", "at a fast pace"],
            "normal": ["", "at a normal pace", "steadily"],
            "none": [""]}[speed]


def _turn_phrases(side: str, deg: float) -> list[str]:
    """Ways to say a turn of `deg` degrees to `side` (after 'turns')."""
    d = int(round(deg))
    clock = "counterclockwise" if side == "left" else "clockwise"
    out = [f"{side} {d} degrees", f"{d} degrees to the {side}", f"{d} degrees {clock}", f"to the {side} by {d} degrees",
           f"{clock} by {d} degrees"]
    named = {90: "a quarter turn", 180: "a half turn", 360: "a full circle"}
    if d in named:
        out += [f"{named[d]} to the {side}", f"{clock} in {named[d]}"]
    if d == 180:
        out += [f"around to the {side}", f"around {clock}"]
    if d == 45:
        out += [f"slightly to the {side}"]
    return out


def caption_templates(spec: MotionSpec) -> list[str]:
    """Every phrasing of the spec, with '{s}' for the subject."""
    k, side, r = spec.kind, spec.side, spec.repetitions
    adv = _adverbs(speed_class(spec))
    out: list[str] = []

    def add(*lines):
        out.extend(" ".join(line.split()) for line in lines)

    if k == "walk":
        for a in adv:
            add(f"{{s}} walks forward {a}", f"{{s}} walks {a} in a straight line", f"{{s}} is walking forward {a}",
                f"{{s}} walks {a} ahead", f"{{s}} takes several steps forward {a}")
    elif k == "run":
        sc = speed_class(spec)
        if sc == "slow":
            add("{s} jogs forward", "{s} is jogging straight ahead", "{s} runs forward slowly", "{s} jogs in a line")
        elif sc == "fast":
            add("{s} sprints forward", "{s} runs forward quickly", "{s} runs fast in a straight line",
                "{s} is sprinting ahead")
        else:
            add("{s} runs forward", "{s} is running straight ahead", "{s} runs in a straight line")
    elif k == "walk_backward":
        for a in adv:
            add(f"{{s}} walks backwards {a}", f"{{s}} walks backward {a}", f"{{s}} steps backwards {a}",
                f"{{s}} moves backward {a} while facing forward")
    elif k == "sidestep":
        clock_free = [f"to the {side}", f"to their {side}", f"{side}"]
        for a in adv:
            for c in clock_free:
                add(f"{{s}} side steps {c} {a}", f"{{s}} walks sideways {c} {a}")
        add(f"{{s}} shuffles sideways to the {side}", f"{{s}} steps sideways towards the {side}")
    elif k == "turn":
        for ph in _turn_phrases(side, spec.turn_deg):
            add(f"{{s}} turns {ph}", f"{{s}} turns in place {ph}", f"standing still, {{s}} turns {ph}")
        add(f"{{s}} pivots on the spot towards the {side}")
    elif k == "jump":
        cnt = _COUNT[r]
        if spec.speed > 0:
            add(f"{{s}} jumps forward {cnt}", f"{{s}} leaps forward {cnt}", f"{{s}} hops forward with both feet {cnt}")
            if r > 1:
                add(f"{{s}} does {_NUMBER[r]} jumps forward")
        else:
            add(f"{{s}} jumps up and down {cnt}", f"{{s}} jumps in place {cnt}", f"{{s}} hops {cnt} on the spot")
            if r == 1:
                add("{s} jumps up", "{s} jumps straight up in the air")
            else:
                add(f"{{s}} does {_NUMBER[r]} jumps in place")
    elif k == "squat":
        if r == 1:
            add("{s} squats down and stands back up", "{s} does a squat", "{s} bends the knees into a squat and rises")
        else:
            add(f"{{s}} does {_NUMBER[r]} squats", f"{{s}} squats {_COUNT[r]}", f"{{s}} squats down and up {_COUNT[r]}")
    elif k == "kick":
        cnt = _COUNT[r]
        add(f"{{s}} kicks with the {side} leg {cnt}", f"{{s}} kicks {cnt} with their {side} foot",
            f"{{s}} kicks forward with the {side} leg {cnt}", f"{{s}} lifts the {side} leg and kicks {cnt}")
        if r == 1:
            add(f"{{s}} does a {side} kick", f"{{s}} kicks forward with the {side} foot")
    elif k == "wave":
        add(f"{{s}} waves with the {side} hand", f"{{s}} waves hello with their {side} hand",
            f"{{s}} raises the {side} arm and waves", f"{{s}} lifts their {side} hand and waves it side to side",
            f"{{s}} waves the {side} hand {_COUNT.get(r, 'several times')}")
    elif k == "raise_arms":
        cnt = "" if r == 1 else _COUNT[r]
        if side == "both":
            add(f"{{s}} raises both arms above the head {cnt}", f"{{s}} lifts both arms up {cnt}",
                f"{{s}} puts both hands up in the air {cnt}", f"{{s}} raises their arms over their head {cnt}")
        else:
            add(f"{{s}} raises the {side} arm {cnt}", f"{{s}} lifts their {side} hand above the head {cnt}",
                f"{{s}} raises the {side} hand up in the air {cnt}", f"{{s}} reaches up with the {side} arm {cnt}")
    elif k == "walk_then_turn":
        for a in adv:
            for ph in _turn_phrases(side, spec.turn_deg)[:3]:
                add(f"{{s}} walks forward {a}, then turns {ph}", f"{{s}} walks {a} and then turns {ph}",
                    f"{{s}} walks ahead {a}, stops and turns {ph}")
    elif k == "walk_and_wave":
        for a in adv:
            add(f"{{s}} walks forward {a} while waving the {side} hand",
                f"{{s}} waves with the {side} hand while walking {a}",
                f"while walking forward {a}, {{s}} waves their {side} hand")
    return [line.replace(" ,", ",") for line in out]


def caption(spec: MotionSpec, rng: np.random.Generator) -> str:
    """One caption of the spec, phrasing and subject drawn from `rng`."""
    templates = caption_templates(spec)
    text = templates[int(rng.integers(len(templates)))]
    return text.format(s=SUBJECTS[int(rng.integers(len(SUBJECTS)))])
