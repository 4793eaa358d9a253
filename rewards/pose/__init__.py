"""Camera-trajectory estimators: what `cam_score` asks for the camera poses of a video.

An estimator maps videos and their intrinsics to per-frame world-to-camera poses, never looking at the
generator. One interface, several implementations, chosen by name (config reward.cam.estimator):

  - "landmarks": PnP on the synthetic world's coloured landmarks of known 3D position (rewards/pose/landmarks.py);
  - "sfm": structure-from-motion with pycolmap (SIFT, exhaustive matching, global mapping with the intrinsics
    fixed), with a rotation-only solve beside it for degenerate motion (rewards/pose/sfm.py);
  - "served": an HTTP endpoint running a learned estimator (VGGT, MASt3R, ...) elsewhere (rewards/pose/served.py).

Conventions: frames (F, H, W, 3) uint8 RGB; intrinsics K (3, 3) in pixels (OpenCV: pixel (row i, col j) has its
centre at u = j, v = i); poses (F, 3, 4) world-to-camera [R|t] in OpenCV axes, in any world frame and any
scale (cam_score makes them relative to the first frame and normalises the scale). A frame that could not be
estimated is NaN in `poses`, False in `ok` and has a reason in `reasons`.
"""

from __future__ import annotations

# Each module imports its heavy dependency (pycolmap, httpx) only when an estimator is built, so every name is known
# even where one is not installed, and building it says what to install.
from rewards.pose import landmarks, served, sfm  # noqa: F401  (self-registering)

# the interface, for `from rewards.pose import ...`; the built-in estimators above import it from
# rewards.pose.estimator itself, so that this package can load them without the two importing each other
from rewards.pose.estimator import (  # noqa: F401
    ESTIMATORS,
    NOT_SENT,
    STILL_TOLERANCE,
    EstimatorFactory,
    PoseEstimate,
    PoseEstimator,
    build_estimator,
    centre_parallax,
    close_estimator,
    known_estimators,
    register_estimator,
    to_uint8_frames,
)
