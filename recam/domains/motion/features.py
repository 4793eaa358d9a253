"""HumanML3D's 263-feature motion representation: joints -> features, features -> joints, Mean/Std.

Layout of one feature row (frame t of a clip with T joint frames gives rows t = 0..T-2):

    [0]        root angular velocity about y: half the increment of the root rotation angle from t to t+1 (rad);
               the root rotation is the yaw that turns the body's facing onto +z, so positive = turning right
    [1:3]      root linear velocity (x, z) from t to t+1, rotated into the root frame of t+1 (m/frame)
    [3]        root height at t (m; the floor is at 0)
    [4:67]     joints 1..21 at t relative to the root's xz (absolute y), rotated by the root rotation of t ("ric")
    [67:193]   joints 1..21 local rotations as 6D (first two columns of the matrix), see `ik_rotations`
    [193:259]  joints 0..21 velocities from t to t+1, rotated by the root rotation of t (m/frame)
    [259:263]  foot contacts of joints 7, 10, 8, 11 between t and t+1 (squared displacement < 0.002 m^2)

Checked against the published data: HumanML3D's sample clip 012314 (its `new_joints` in) gives its
`new_joint_vecs` to within 1e-5 in every feature group, rotations and contacts included, over the rows that the
missing last frame does not reach through the facing smoothing (`tests/test_motion_world.py`, run with
RECAM_HUMANML3D_SAMPLE set); `features_to_joints` of its `new_joint_vecs` gives its `new_joints` to 2e-7.
How our procedure relates to the reference scripts (`motion_representation.py`, `common/skeleton.py`):

* Canonicalisation is theirs: floor = min y over all joints and frames; frame-0 root xz at the origin; frame-0
  facing, from right-minus-left hips plus right-minus-left shoulders, turned onto +z.
* The per-frame root rotation is theirs, quirks included, because every group except the root height depends on
  it and models/evaluators trained on the real data expect it: their IK unpacks the face joints in a different
  order, so its "across" vector is (left hip - right hip) + (right shoulder - left shoulder) -- the hips count with
  the wrong sign and the shoulders dominate; the forward vector is smoothed over time (Gaussian, sigma 20 frames,
  'nearest' edges); frame 0's root rotation is the identity (the published files were built with that line active:
  their first feature-0 value carries the jump to the smoothed facing of frame 1, and `new_joints` frame 0 faces
  +z exactly).  One deliberate difference: feature 0 is half the *wrapped* yaw increment.  Theirs is the arcsin
  of the y component of a quaternion product whose w can turn negative when the facing crosses 180 degrees
  (their quaternions are not sign-fixed), which flips the sign of that one frame's value.
* 6D rotations follow their swing-only IK against the axis-aligned bone directions `skeleton.IK_DIRECTIONS`:
  each chain starts from the root rotation (so the arm chains ignore the spine), each bone's global rotation is
  the minimal rotation from its rest direction to its current one, and the value stored at a joint is that
  bone's rotation relative to the previous bone of the chain.  These features are not needed to recover joints
  (ric + root do that, and `features_to_joints` uses nothing else); they are kept so that models and the T2M
  evaluator see what they saw on real data.
* No retargeting: HumanML3D first re-poses every clip on its reference skeleton ("uniform skeleton"); our joints
  already have the reference bone lengths (`skeleton.BONE_LENGTHS`).  Real AMASS joints would need that step.

Joint frames kept: features have T-1 rows and `features_to_joints` returns T-1 frames, equal to frames 0..T-2 of
`canonicalise(joints)` -- the last frame only exists as the end of the last velocities.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.ndimage import gaussian_filter1d

from recam.domains.motion import skeleton as sk

# Feature groups, as slices of the 263 (one place for the layout).
ROOT_ROT_VEL = slice(0, 1)
ROOT_LIN_VEL = slice(1, 3)
ROOT_HEIGHT = slice(3, 4)
RIC = slice(4, 4 + 21 * 3)  # 4:67
ROT6D = slice(67, 67 + 21 * 6)  # 67:193
LOCAL_VEL = slice(193, 193 + 22 * 3)  # 193:259
CONTACTS = slice(259, 263)
STD_GROUPS: tuple[slice, ...] = (ROOT_ROT_VEL, ROOT_LIN_VEL, ROOT_HEIGHT, RIC, ROT6D, LOCAL_VEL, CONTACTS)
assert CONTACTS.stop == sk.NUM_FEATURES

FORWARD_SMOOTH_SIGMA = 20.0  # frames, HumanML3D's smoothing of the root's forward direction
# (left hip, right hip, right shoulder, left shoulder) as HumanML3D's IK effectively reads them, see module doc.
IK_ACROSS_JOINTS: tuple[int, int, int, int] = (1, 2, 17, 16)


# ----------------------------------------------------------------------------------------------------------------
# Small geometry helpers (numpy)


def facing_from_across(across: np.ndarray) -> np.ndarray:
    """Horizontal forward vectors (..., 3), unnormalised: up x across (the body's left-to-right vector)."""
    return np.stack([across[..., 2], np.zeros_like(across[..., 0]), -across[..., 0]], axis=-1)


def facing_yaw(joints: np.ndarray, face_joints=sk.FACE_JOINTS) -> np.ndarray:
    """Body yaw (...,) from hips and shoulders: the angle of rot_y that turns +z onto the facing direction.

    `face_joints` = (right hip, left hip, right shoulder, left shoulder); across = (r_hip - l_hip) + (r_sh - l_sh).
    """
    r_hip, l_hip, r_sh, l_sh = face_joints
    across = (joints[..., r_hip, :] - joints[..., l_hip, :]) + (joints[..., r_sh, :] - joints[..., l_sh, :])
    fwd = facing_from_across(across)
    return np.arctan2(fwd[..., 0], fwd[..., 2])


def wrap_angle(a):
    """Angles wrapped to [-pi, pi)."""
    return (np.asarray(a) + np.pi) % (2.0 * np.pi) - np.pi


def swing_matrices(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Minimal rotations (..., 3, 3) taking unit vectors u onto unit vectors v (Rodrigues, no twist).

    Opposite vectors have no unique minimal rotation; there we turn by pi about the axis u x e (e the coordinate
    axis least aligned with u), a fixed choice where HumanML3D's quaternion formula divides by zero.
    """
    u, v = np.broadcast_arrays(np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64))
    c = np.sum(u * v, axis=-1)
    k = np.cross(u, v)
    zeros = np.zeros_like(c)
    kx = np.stack(
        [np.stack([zeros, -k[..., 2], k[..., 1]], -1),
         np.stack([k[..., 2], zeros, -k[..., 0]], -1),
         np.stack([-k[..., 1], k[..., 0], zeros], -1)], -2
    )
    eye = np.broadcast_to(np.eye(3), kx.shape)
    opposite = (1.0 + c) < 1e-12
    denom = np.where(opposite, 1.0, 1.0 + c)
    out = eye + kx + (kx @ kx) / denom[..., None, None]
    if np.any(opposite):
        uo = u[opposite]
        e = np.eye(3)[np.argmin(np.abs(uo), axis=-1)]
        a = np.cross(uo, e)
        a /= np.linalg.norm(a, axis=-1, keepdims=True)
        out[opposite] = 2.0 * a[..., :, None] * a[..., None, :] - np.eye(3)
    return out


def matrix_to_6d(rot: np.ndarray) -> np.ndarray:
    """6D representation (..., 6): the first two columns of the rotation matrix, column by column."""
    return np.concatenate([rot[..., :, 0], rot[..., :, 1]], axis=-1)


def rot6d_to_matrix(d6):
    """Rotation matrices (..., 3, 3) from 6D (..., 6) by Gram-Schmidt (torch or numpy)."""
    if isinstance(d6, torch.Tensor):
        x = torch.nn.functional.normalize(d6[..., 0:3], dim=-1)
        z = torch.nn.functional.normalize(torch.cross(x, d6[..., 3:6], dim=-1), dim=-1)
        y = torch.cross(z, x, dim=-1)
        return torch.stack([x, y, z], dim=-1)
    d6 = np.asarray(d6, dtype=np.float64)
    x = d6[..., 0:3] / np.linalg.norm(d6[..., 0:3], axis=-1, keepdims=True)
    z = np.cross(x, d6[..., 3:6])
    z /= np.linalg.norm(z, axis=-1, keepdims=True)
    return np.stack([x, np.cross(z, x), z], axis=-1)


# ----------------------------------------------------------------------------------------------------------------
# Joints -> features


def canonicalise(joints: np.ndarray) -> np.ndarray:
    """HumanML3D's canonical placement of a clip (T, 22, 3): floor at 0, frame-0 root xz at 0, frame 0 facing +z."""
    joints = np.asarray(joints, dtype=np.float64)
    out = joints.copy()
    out[..., 1] -= joints[..., 1].min()
    out[..., [0, 2]] -= joints[0, 0, [0, 2]]
    yaw0 = facing_yaw(out[0])
    return np.einsum("ij,tkj->tki", sk.rot_y(-yaw0), out)


def root_yaw(canonical: np.ndarray, sigma: float = FORWARD_SMOOTH_SIGMA) -> np.ndarray:
    """Per-frame root yaw (T,) used by every feature group, HumanML3D's way (see module doc); yaw[0] = 0."""
    l_hip, r_hip, r_sh, l_sh = IK_ACROSS_JOINTS
    across = (canonical[:, l_hip] - canonical[:, r_hip]) + (canonical[:, r_sh] - canonical[:, l_sh])
    across = across / np.linalg.norm(across, axis=-1, keepdims=True)
    fwd = facing_from_across(across)
    if sigma > 0:
        fwd = gaussian_filter1d(fwd, sigma, axis=0, mode="nearest")
    yaw = np.arctan2(fwd[:, 0], fwd[:, 2])
    yaw[0] = 0.0
    return yaw


def ik_rotations(canonical: np.ndarray, yaw: np.ndarray) -> np.ndarray:
    """Local rotations (T, 22, 3, 3) by HumanML3D's chain-wise swing IK; entry 0 is the root rotation rot_y(-yaw)."""
    T = canonical.shape[0]
    out = np.empty((T, sk.NUM_JOINTS, 3, 3))
    root = sk.rot_y(-yaw)
    out[:, 0] = root
    for chain in sk.KINEMATIC_CHAINS:
        prev = root
        for a, b in zip(chain[:-1], chain[1:], strict=True):
            bone = canonical[:, b] - canonical[:, a]
            bone = bone / np.linalg.norm(bone, axis=-1, keepdims=True)
            glob = swing_matrices(sk.IK_DIRECTIONS[b], bone)
            out[:, b] = np.swapaxes(prev, -1, -2) @ glob
            prev = glob
    return out


def foot_contacts(canonical: np.ndarray, threshold: float = sk.CONTACT_THRESHOLD) -> np.ndarray:
    """Contacts (T-1, 4) for joints 7, 10, 8, 11: squared displacement from t to t+1 below `threshold` (m^2)."""
    feet = canonical[:, list(sk.CONTACT_JOINTS)]
    disp2 = np.sum((feet[1:] - feet[:-1]) ** 2, axis=-1)
    return (disp2 < threshold).astype(np.float64)


def joints_to_features(joints: np.ndarray, *, smooth_sigma: float = FORWARD_SMOOTH_SIGMA) -> np.ndarray:
    """HumanML3D features (T-1, 263) float64 of a clip of joint positions (T, 22, 3) on the reference skeleton."""
    joints = np.asarray(joints, dtype=np.float64)
    if joints.ndim != 3 or joints.shape[1:] != (sk.NUM_JOINTS, 3) or joints.shape[0] < 2:
        raise ValueError(f"expected joints (T>=2, 22, 3), got {joints.shape}")
    pos = canonicalise(joints)
    T = pos.shape[0]
    yaw = root_yaw(pos, smooth_sigma)
    r_rot = sk.rot_y(-yaw)  # turns the body's facing onto +z

    root_step = pos[1:, 0] - pos[:-1, 0]
    root_vel = np.einsum("tij,tj->ti", r_rot[1:], root_step)[:, [0, 2]]
    root_rot_vel = -0.5 * wrap_angle(yaw[1:] - yaw[:-1])

    rel = pos.copy()
    rel[..., [0, 2]] -= pos[:, :1, [0, 2]]
    ric = np.einsum("tij,tkj->tki", r_rot, rel)[:, 1:]

    rot6d = matrix_to_6d(ik_rotations(pos, yaw)[:, 1:])

    local_vel = np.einsum("tij,tkj->tki", r_rot[:-1], pos[1:] - pos[:-1])

    feats = np.concatenate(
        [
            root_rot_vel[:, None],
            root_vel,
            pos[:-1, 0, 1:2],
            ric[:-1].reshape(T - 1, -1),
            rot6d[:-1].reshape(T - 1, -1),
            local_vel.reshape(T - 1, -1),
            foot_contacts(pos),
        ],
        axis=-1,
    )
    assert feats.shape == (T - 1, sk.NUM_FEATURES)
    return feats


# ----------------------------------------------------------------------------------------------------------------
# Features -> joints (torch, batched; what rewards use)


def recover_root(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Root yaw (..., T) (body facing, rot_y angle) and root positions (..., T, 3) from features (..., T, 263)."""
    # Feature 0 is half the increment of the root rotation, which is minus the body yaw.
    half = torch.zeros_like(features[..., 0])
    half[..., 1:] = features[..., :-1, 0]
    yaw = -2.0 * torch.cumsum(half, dim=-1)
    c, s = torch.cos(yaw), torch.sin(yaw)
    vx = torch.zeros_like(half)
    vz = torch.zeros_like(half)
    vx[..., 1:] = features[..., :-1, 1]
    vz[..., 1:] = features[..., :-1, 2]
    # Step from t-1 to t = rot_y(yaw_t) (vx, 0, vz).
    step_x = c * vx + s * vz
    step_z = -s * vx + c * vz
    root = torch.stack([torch.cumsum(step_x, -1), features[..., 3], torch.cumsum(step_z, -1)], dim=-1)
    return yaw, root


def features_to_joints(features) -> torch.Tensor:
    """Joint positions (..., T, 22, 3) from HumanML3D features (..., T, 263), using only root and ric features.

    Accepts numpy arrays too; the dtype of a tensor is kept.
    """
    if not isinstance(features, torch.Tensor):
        features = torch.as_tensor(np.asarray(features))
    yaw, root = recover_root(features)
    ric = features[..., RIC].reshape(features.shape[:-1] + (sk.NUM_JOINTS - 1, 3))
    c, s = torch.cos(yaw)[..., None], torch.sin(yaw)[..., None]
    x = c * ric[..., 0] + s * ric[..., 2] + root[..., None, 0]
    z = -s * ric[..., 0] + c * ric[..., 2] + root[..., None, 2]
    others = torch.stack([x, ric[..., 1], z], dim=-1)
    return torch.cat([root[..., None, :], others], dim=-2)


# ----------------------------------------------------------------------------------------------------------------
# Normalisation


def mean_std(feature_arrays) -> tuple[np.ndarray, np.ndarray]:
    """Mean (263,) and Std (263,) over all frames of all clips, HumanML3D's way.

    The mean is per feature.  The std is per feature, then replaced within each group (root rotation velocity,
    root linear velocity, root height, ric, 6D rotations, local velocities, contacts) by the group's average, as
    `cal_mean_variance.py` does (its group weights are all 1 in the released version), so that normalisation keeps
    the relative scale of the features inside a group (e.g. a hand moves more than the pelvis).  A group whose
    average std is 0 gets std 1 so that normalising never divides by zero.
    """
    data = np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1, sk.NUM_FEATURES) for a in feature_arrays])
    mean = data.mean(axis=0)
    std = data.std(axis=0)
    for group in STD_GROUPS:
        g = std[group].mean()
        std[group] = g if g > 0 else 1.0
    return mean, std


def normalise(features, mean, std):
    return (features - mean) / std


def denormalise(features, mean, std):
    return features * std + mean
