"""The 22-joint HumanML3D skeleton (SMPL body joints without hands): names, chains, bone lengths, rest pose and FK.

Conventions (the same as HumanML3D's `new_joints`): metres, y up, the body faces +z, its left side is +x.
Every list of joint indices used by the motion domain lives here, so that features, synthesis, rewards and
loaders cannot disagree about which index is which joint.

Rotations are 3x3 matrices acting on column vectors.  A joint's *local* rotation turns the bones that leave it,
expressed in its parent's frame: ``G[j] = G[parent[j]] @ L[j]`` and
``p[c] = p[j] + G[j] @ REST_OFFSETS[c]`` for each child ``c`` of ``j``; the root's local rotation is its global one.
With every local rotation the identity, FK gives the rest pose (standing, arms hanging, feet forward).
"""

from __future__ import annotations

import numpy as np

FPS = 20
MAX_FRAMES = 196  # MDM pads every clip to this many frames
MIN_FRAMES = 40  # MDM drops shorter clips
NUM_JOINTS = 22
NUM_FEATURES = 263  # 4 root + 21*3 ric + 21*6 rot + 22*3 vel + 4 contacts

JOINT_NAMES: tuple[str, ...] = (
    "pelvis",  # 0
    "left_hip",  # 1
    "right_hip",  # 2
    "spine1",  # 3
    "left_knee",  # 4
    "right_knee",  # 5
    "spine2",  # 6
    "left_ankle",  # 7
    "right_ankle",  # 8
    "spine3",  # 9
    "left_foot",  # 10
    "right_foot",  # 11
    "neck",  # 12
    "left_collar",  # 13
    "right_collar",  # 14
    "head",  # 15
    "left_shoulder",  # 16
    "right_shoulder",  # 17
    "left_elbow",  # 18
    "right_elbow",  # 19
    "left_wrist",  # 20
    "right_wrist",  # 21
)
JOINT_INDEX: dict[str, int] = {name: i for i, name in enumerate(JOINT_NAMES)}

# HumanML3D's `t2m_kinematic_chain`, in its order (right leg, left leg, spine, right arm, left arm).
KINEMATIC_CHAINS: tuple[tuple[int, ...], ...] = (
    (0, 2, 5, 8, 11),
    (0, 1, 4, 7, 10),
    (0, 3, 6, 9, 12, 15),
    (9, 14, 17, 19, 21),
    (9, 13, 16, 18, 20),
)


def _parents_from_chains(chains) -> np.ndarray:
    parents = np.full(NUM_JOINTS, -1, dtype=np.int64)
    for chain in chains:
        for a, b in zip(chain[:-1], chain[1:], strict=True):
            parents[b] = a
    return parents


PARENTS: np.ndarray = _parents_from_chains(KINEMATIC_CHAINS)
# Every parent precedes its child, so one pass in index order is a valid FK/IK traversal.
assert all(PARENTS[j] < j for j in range(1, NUM_JOINTS))

# Bone lengths (m) of HumanML3D's reference skeleton (the one every clip is retargeted to), indexed by child joint.
BONE_LENGTHS: np.ndarray = np.array(
    [0.0, 0.103, 0.110, 0.132, 0.394, 0.390, 0.143, 0.432, 0.426, 0.057, 0.143,
     0.149, 0.219, 0.138, 0.143, 0.103, 0.132, 0.123, 0.257, 0.263, 0.266, 0.270],
    dtype=np.float64,
)

# Feet.  HumanML3D's contact features are, in order, left ankle, left foot, right ankle, right foot.
LEFT_ANKLE, RIGHT_ANKLE, LEFT_FOOT, RIGHT_FOOT = 7, 8, 10, 11
FOOT_JOINTS: tuple[int, ...] = (LEFT_ANKLE, LEFT_FOOT, RIGHT_ANKLE, RIGHT_FOOT)
CONTACT_JOINTS: tuple[int, ...] = FOOT_JOINTS
FEET_LEFT: tuple[int, ...] = (LEFT_ANKLE, LEFT_FOOT)
FEET_RIGHT: tuple[int, ...] = (RIGHT_ANKLE, RIGHT_FOOT)
CONTACT_THRESHOLD = 0.002  # m^2 of squared displacement per frame (HumanML3D's `feet_thre`)

# Facing is taken from these: right hip, left hip, right shoulder, left shoulder (HumanML3D's `face_joint_indx`).
FACE_JOINTS: tuple[int, int, int, int] = (2, 1, 17, 16)

LEFT_RIGHT_PAIRS: tuple[tuple[int, int], ...] = (
    (1, 2), (4, 5), (7, 8), (10, 11), (13, 14), (16, 17), (18, 19), (20, 21),
)


def _mirror_index() -> np.ndarray:
    index = np.arange(NUM_JOINTS)
    for a, b in LEFT_RIGHT_PAIRS:
        index[a], index[b] = b, a
    return index


# Joint j of a mirrored clip is joint MIRROR_INDEX[j] of the original with x negated (HumanML3D's `M` clips).
MIRROR_INDEX: np.ndarray = _mirror_index()
MIRROR_MATRIX: np.ndarray = np.diag([-1.0, 1.0, 1.0])


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


# Directions of each bone (parent -> joint) in the rest pose.  Anatomical rather than axis-aligned so that the
# synthetic bodies look like SMPL ones (hips below and beside the pelvis, toes forward and down, head forward of
# the neck); left and right are exact mirrors, only the bone lengths differ slightly, as in the reference skeleton.
REST_DIRECTIONS: np.ndarray = _unit(
    np.array(
        [
            [0.0, 1.0, 0.0],  # 0 pelvis (no bone; placeholder)
            [0.6, -0.8, -0.05],  # 1 left_hip
            [-0.6, -0.8, -0.05],  # 2 right_hip
            [0.0, 1.0, -0.1],  # 3 spine1
            [0.0, -1.0, 0.0],  # 4 left_knee
            [0.0, -1.0, 0.0],  # 5 right_knee
            [0.0, 1.0, 0.05],  # 6 spine2
            [0.0, -1.0, -0.04],  # 7 left_ankle
            [0.0, -1.0, -0.04],  # 8 right_ankle
            [0.0, 1.0, 0.0],  # 9 spine3
            [0.0, -0.45, 0.9],  # 10 left_foot (toe base: forward and down from the ankle)
            [0.0, -0.45, 0.9],  # 11 right_foot
            [0.0, 1.0, 0.1],  # 12 neck
            [0.6, 0.8, -0.05],  # 13 left_collar
            [-0.6, 0.8, -0.05],  # 14 right_collar
            [0.0, 0.9, 0.35],  # 15 head
            [1.0, 0.15, -0.05],  # 16 left_shoulder
            [-1.0, 0.15, -0.05],  # 17 right_shoulder
            [0.15, -1.0, 0.0],  # 18 left_elbow (arms hang, slightly away from the body)
            [-0.15, -1.0, 0.0],  # 19 right_elbow
            [0.05, -1.0, 0.08],  # 20 left_wrist
            [-0.05, -1.0, 0.08],  # 21 right_wrist
        ]
    )
)
REST_OFFSETS: np.ndarray = REST_DIRECTIONS * BONE_LENGTHS[:, None]
REST_OFFSETS[0] = 0.0

# The bone directions HumanML3D's inverse kinematics measures rotations against (its `t2m_raw_offsets`):
# axis-aligned, arms hanging, feet and head pointing forward.  Our 6D rotation features use the same ones so that
# they mean what the real dataset's do.
IK_DIRECTIONS: np.ndarray = np.array(
    [
        [0, 0, 0], [1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, -1, 0], [0, 1, 0], [0, -1, 0],
        [0, -1, 0], [0, 1, 0], [0, 0, 1], [0, 0, 1], [0, 1, 0], [1, 0, 0], [-1, 0, 0], [0, 0, 1],
        [0, -1, 0], [0, -1, 0], [0, -1, 0], [0, -1, 0], [0, -1, 0], [0, -1, 0],
    ],
    dtype=np.float64,
)


# ----------------------------------------------------------------------------------------------------------------
# Rotations (pure functions of arrays; broadcast over leading axes)


def rot_x(angle) -> np.ndarray:
    """Rotation about +x by `angle` radians (right-handed), shape angle.shape + (3, 3)."""
    a = np.asarray(angle, dtype=np.float64)
    c, s, o, z = np.cos(a), np.sin(a), np.ones_like(a), np.zeros_like(a)
    return np.stack([np.stack([o, z, z], -1), np.stack([z, c, -s], -1), np.stack([z, s, c], -1)], -2)


def rot_y(angle) -> np.ndarray:
    """Rotation about +y (yaw; positive turns +z towards +x, i.e. the body towards its left)."""
    a = np.asarray(angle, dtype=np.float64)
    c, s, o, z = np.cos(a), np.sin(a), np.ones_like(a), np.zeros_like(a)
    return np.stack([np.stack([c, z, s], -1), np.stack([z, o, z], -1), np.stack([-s, z, c], -1)], -2)


def rot_z(angle) -> np.ndarray:
    """Rotation about +z by `angle` radians."""
    a = np.asarray(angle, dtype=np.float64)
    c, s, o, z = np.cos(a), np.sin(a), np.ones_like(a), np.zeros_like(a)
    return np.stack([np.stack([c, -s, z], -1), np.stack([s, c, z], -1), np.stack([z, z, o], -1)], -2)


def mirror_rotations(local_rot: np.ndarray) -> np.ndarray:
    """Local rotations (..., 22, 3, 3) of the left/right mirrored body (x negated, chains swapped)."""
    m = MIRROR_MATRIX
    return m @ np.asarray(local_rot)[..., MIRROR_INDEX, :, :] @ m


def mirror_joints(joints: np.ndarray) -> np.ndarray:
    """Positions (..., 22, 3) of the mirrored body, as HumanML3D builds its `M` clips."""
    out = np.asarray(joints)[..., MIRROR_INDEX, :].copy()
    out[..., 0] *= -1.0
    return out


# ----------------------------------------------------------------------------------------------------------------
# Forward kinematics


def forward_kinematics(local_rot: np.ndarray, root_pos: np.ndarray, offsets: np.ndarray = REST_OFFSETS) -> np.ndarray:
    """Joint positions (..., 22, 3) from local rotations (..., 22, 3, 3) and root positions (..., 3).

    `offsets` (22, 3) or (..., 22, 3) are the rest-pose bone vectors (parent -> joint); their lengths are what
    every generated frame keeps exactly.
    """
    local_rot = np.asarray(local_rot, dtype=np.float64)
    root_pos = np.asarray(root_pos, dtype=np.float64)
    lead = np.broadcast_shapes(local_rot.shape[:-3], root_pos.shape[:-1])
    offsets = np.broadcast_to(np.asarray(offsets, dtype=np.float64), lead + (NUM_JOINTS, 3))
    glob = [None] * NUM_JOINTS
    pos = [None] * NUM_JOINTS
    glob[0] = np.broadcast_to(local_rot[..., 0, :, :], lead + (3, 3))
    pos[0] = np.broadcast_to(root_pos, lead + (3,))
    for j in range(1, NUM_JOINTS):
        p = PARENTS[j]
        pos[j] = pos[p] + np.einsum("...ij,...j->...i", glob[p], offsets[..., j, :])
        glob[j] = glob[p] @ local_rot[..., j, :, :]
    return np.stack(pos, axis=-2)


def rest_rotations(lead_shape: tuple[int, ...] = ()) -> np.ndarray:
    """Identity local rotations, shape lead_shape + (22, 3, 3)."""
    return np.broadcast_to(np.eye(3), tuple(lead_shape) + (NUM_JOINTS, 3, 3)).copy()


def rest_pose() -> np.ndarray:
    """Rest-pose joints (22, 3) standing on the floor (lowest joint at y = 0), pelvis above the origin."""
    joints = forward_kinematics(rest_rotations(), np.zeros(3))
    joints[:, 1] -= joints[:, 1].min()
    return joints


def rest_pelvis_height() -> float:
    """Pelvis height (m) of the rest pose standing on the floor."""
    return float(rest_pose()[0, 1])


def bone_lengths(joints: np.ndarray) -> np.ndarray:
    """Lengths (..., 22) of the bones parent -> joint in `joints` (..., 22, 3); entry 0 is 0."""
    joints = np.asarray(joints)
    out = np.zeros(joints.shape[:-1])
    out[..., 1:] = np.linalg.norm(joints[..., 1:, :] - joints[..., PARENTS[1:], :], axis=-1)
    return out
