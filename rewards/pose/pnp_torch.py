"""PnP for a whole batch of frames at once in torch, on the tensors' device: the landmark estimator's default solve.

Per frame, from its found 2D-3D correspondences (at least MIN_LANDMARKS), closed-form starts:
  - affine: the least-squares affine camera x ~ A X + b on the normalised image points, read as a scaled
    orthographic camera (the rows of A are the camera's x and y axes over the depth of the points' centroid);
    it needs only 4 points not on a plane;
  - DLT: the 3 x 4 projection matrix as the null vector of the 2n x 12 direct linear system (world points
    centred and scaled first), its left 3 x 3 block projected onto the rotations; it needs 6 points.
Each start is refined by Levenberg-Marquardt on the pixel reprojection error (OpenCV's objective), the pose updated
on the left (p <- exp([a]) p + b), and the frame keeps the refined start with the least error whose found points
all lie in front of the camera. Frames with 4 or 5 landmarks have no DLT and a poor affine start (4 points fit any
affine camera exactly), so a second pass gives them more: the affine rotation turned by FEW_TILTS about the
camera's axes (each with its least-squares translation), the first pass's solutions of their video's neighbouring
frames, refined longer. The rules for a placed frame are OpenCV's path's (landmarks.estimate_pose): at least
MIN_LANDMARKS found, a finite pose, every found landmark at positive depth.

Against OpenCV's SQPnP-then-LM (tests/test_pnp_torch.py): the same frames placed, the same minimum but for a few
frames with 4 landmarks where this solve's has the lower error. Everything is float64: PnP's jitter at 32 px is
what cam_score's static tolerance is set against. Written from the formulas (DLT, scaled orthography, the
textbook point-projection Jacobian); no solver's code is copied.
"""

from __future__ import annotations

import torch

MIN_LANDMARKS = 4
LM_ITERATIONS = 6
# frames with 4 or 5 landmarks: more starts (the affine start turned by each of FEW_TILTS radians either way about
# the camera's x and y axes) refined for longer (generated frames' minima there needed up to ~20 steps to settle
# to OpenCV's). Random 4-point layouts (tests/test_pnp_torch.py) reach the exact pose from one of these.
FEW_TILTS, FEW_ITERATIONS = (0.5, 1.2, 2.0), 20
FEW_SCREEN_ITERATIONS = 10  # steps every such start gets before the best of a frame's goes on alone
# Levenberg-Marquardt's damping, relative to the normal matrix' diagonal: the first step and its bounds. A
# rejected step multiplies it by LM_GROW, an accepted one divides it by LM_SHRINK.
LM_DAMPING, LM_GROW, LM_SHRINK = 1e-3, 10.0, 10.0
LM_DAMPING_MIN, LM_DAMPING_MAX = 1e-12, 1e8

# reasons, as codes: a frame placed, one with too few landmarks, one the solve could not place
PLACED, TOO_FEW, FAILED = 0, 1, 2


def _skew(v: torch.Tensor) -> torch.Tensor:
    """(..., 3) -> (..., 3, 3) with skew(v) @ x = v x x."""
    z = torch.zeros_like(v[..., 0])
    return torch.stack([torch.stack([z, -v[..., 2], v[..., 1]], -1),
                        torch.stack([v[..., 2], z, -v[..., 0]], -1),
                        torch.stack([-v[..., 1], v[..., 0], z], -1)], -2)


def rodrigues(w: torch.Tensor) -> torch.Tensor:
    """Rotation matrices exp([w]) (..., 3, 3) of axis-angle vectors w (..., 3)."""
    theta2 = (w * w).sum(-1)
    theta = theta2.sqrt()
    small = theta2 < 1e-12
    safe = torch.where(small, torch.ones_like(theta), theta)
    # Taylor series below 1e-6 rad, where sin(t)/t and (1 - cos t)/t^2 lose their digits to cancellation
    a = torch.where(small, 1.0 - theta2 / 6.0, torch.sin(safe) / safe)
    b = torch.where(small, 0.5 - theta2 / 24.0, (1.0 - torch.cos(safe)) / (safe * safe))
    W = _skew(w)
    eye = torch.eye(3, dtype=w.dtype, device=w.device).expand(W.shape)
    return eye + a[..., None, None] * W + b[..., None, None] * (W @ W)


def _nearest_rotation(M: torch.Tensor) -> torch.Tensor:
    """The rotation nearest M (..., 3, 3) in Frobenius norm (polar factor, a reflection turned into a rotation)."""
    finite = torch.isfinite(M).flatten(-2).all(-1)
    # a degenerate layout's start is garbage, not an error: it gets the identity and loses on its cost
    M = torch.where(finite[..., None, None], M, torch.eye(3, dtype=M.dtype, device=M.device).expand(M.shape))
    U, _, Vh = torch.linalg.svd(M)
    d = torch.sign(torch.linalg.det(U @ Vh))
    d = torch.where(d == 0, torch.ones_like(d), d)
    U = torch.cat([U[..., :2], U[..., 2:] * d[..., None, None]], -1)
    return U @ Vh


def _affine_start(xn: torch.Tensor, X: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled orthographic pose from normalised points xn (N, L, 2), world X (N, L, 3), weights w (N, L) 0/1."""
    n = w.sum(-1).clamp_min(1.0)[:, None]
    cX = (w[..., None] * X).sum(1) / n
    cx = (w[..., None] * xn).sum(1) / n
    Xc = (X - cX[:, None]) * w[..., None]
    xc = (xn - cx[:, None]) * w[..., None]
    G = Xc.transpose(1, 2) @ Xc  # (N, 3, 3)
    # a relative ridge keeps near-planar layouts solvable; refinement removes its small bias
    ridge = 1e-9 * G.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(1e-300)
    G = G + ridge[:, None, None] * torch.eye(3, dtype=X.dtype, device=X.device)
    A = torch.linalg.solve(G, Xc.transpose(1, 2) @ xc).transpose(1, 2)  # (N, 2, 3): x ~ A (X - cX)
    scale = 0.5 * (A[:, 0].norm(dim=-1) + A[:, 1].norm(dim=-1))
    R = _nearest_rotation(torch.cat([A, torch.linalg.cross(A[:, 0], A[:, 1])[:, None] / scale[:, None, None]], 1)
                          / scale[:, None, None])
    depth = 1.0 / scale
    centre = torch.cat([cx * depth[:, None], depth[:, None]], -1)  # the world centroid in the camera
    return R, centre - (R @ cX[..., None])[..., 0]


def _translation_for(R: torch.Tensor, xn: torch.Tensor, X: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The translation (N, 3) that best fits rotation R (N, 3, 3) to the points, in the linear (algebraic) sense:
    x (r3 . X + tz) = r1 . X + tx and likewise for y, by least squares."""
    q = X @ R.transpose(1, 2)  # R X
    x, y = xn[..., 0], xn[..., 1]
    zero, one = torch.zeros_like(x), torch.ones_like(x)
    rows = torch.cat([torch.stack([one, zero, -x], -1), torch.stack([zero, one, -y], -1)], 1)  # (N, 2L, 3)
    rhs = torch.cat([x * q[..., 2] - q[..., 0], y * q[..., 2] - q[..., 1]], 1)
    ww = torch.cat([w, w], 1)[..., None]
    A = (rows * ww).transpose(1, 2) @ rows
    b = ((rows * ww) * rhs[..., None]).sum(1)
    ridge = 1e-12 * A.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(1e-300)
    return _solve_spd(A + ridge[:, None, None] * torch.eye(3, dtype=A.dtype, device=A.device), b)


def _dlt_start(xn: torch.Tensor, X: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pose from the direct linear transform on normalised points (see _affine_start for shapes)."""
    n = w.sum(-1).clamp_min(1.0)[:, None]
    cX = (w[..., None] * X).sum(1) / n
    spread = ((w * ((X - cX[:, None]) ** 2).sum(-1)).sum(-1) / n[:, 0]).sqrt().clamp_min(1e-12)
    Y = (X - cX[:, None]) / spread[:, None, None]  # centred, unit RMS distance: a conditioned system
    Yh = torch.cat([Y, torch.ones_like(Y[..., :1])], -1)  # (N, L, 4)
    zero = torch.zeros_like(Yh)
    x, y = xn[..., 0:1], xn[..., 1:2]
    rows = torch.stack([torch.cat([Yh, zero, -x * Yh], -1), torch.cat([zero, Yh, -y * Yh], -1)], 2)  # (N, L, 2, 12)
    rows = (rows * w[..., None, None]).flatten(1, 2)
    _, vecs = torch.linalg.eigh(torch.nan_to_num(rows.transpose(1, 2) @ rows))
    P = vecs[..., 0].reshape(-1, 3, 4)  # the least eigenvalue's vector
    M, p = P[..., :3], P[..., 3]
    sign = torch.sign(torch.linalg.det(M))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    M, p = M * sign[:, None, None], p * sign[:, None]
    lam = torch.linalg.svdvals(M).mean(-1).clamp_min(1e-300)
    R = _nearest_rotation(M)
    t_norm = p / lam[:, None]  # camera = R Y + t_norm, Y = (X - cX) / spread: scale by spread back to X's unit
    return R, spread[:, None] * t_norm - (R @ cX[..., None])[..., 0]


def _apply(R: torch.Tensor, t: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """R X + t for R (N, 3, 3), t (N, 3), X (N, L, 3), written out: a CPU's batched 3 x 3 matmul is the slower."""
    Xs = [X[..., j] for j in range(3)]
    return torch.stack([R[:, k, 0, None] * Xs[0] + R[:, k, 1, None] * Xs[1] + R[:, k, 2, None] * Xs[2]
                        + t[:, k, None] for k in range(3)], -1)


def _project(R, t, X, xn, w, fx, fy):
    """Camera points (N, L, 3), their normalised image coordinates x, y (N, L), residuals in pixels ru, rv (N, L)
    (zero where w is 0) and the cost (N,): the sum of squared pixel residuals. Pixels are fx, fy times normalised
    coordinates (K's skew is folded into xn), so this is OpenCV's reprojection error."""
    p = _apply(R, t, X)
    z = p[..., 2]
    zs = torch.where(z.abs() > 1e-300, z, torch.ones_like(z))
    x, y = p[..., 0] / zs, p[..., 1] / zs
    ru = (x - xn[..., 0]) * fx * w
    rv = (y - xn[..., 1]) * fy * w
    return p, x, y, ru, rv, (ru * ru + rv * rv).sum(-1)


def _solve_spd(H: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """H^-1 g for symmetric positive definite H (N, n, n), g (N, n). On a CPU by Cholesky written out
    (_solve_spd_unrolled); elsewhere by the library's batched Cholesky: there each of the unrolled version's ~150
    elementwise operations per solve would be a kernel launch."""
    if H.device.type == "cpu":
        return _solve_spd_unrolled(H, g)
    return _solve_spd_library(H, g)


def _solve_spd_library(H: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    L, _ = torch.linalg.cholesky_ex(H)  # a failed factor gives a non-finite step, which LM rejects
    return torch.cholesky_solve(g[..., None], L)[..., 0]


def _solve_spd_unrolled(H: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """_solve_spd by Cholesky written out: on a CPU torch's batched factorisations of 2,048 or more 6 x 6 matrices
    cost several times these elementwise passes (3.5 against 12.8 ms for 20,000 on one thread)."""
    n = H.shape[-1]
    Lm = [[None] * n for _ in range(n)]
    for j in range(n):
        d = H[:, j, j]
        for k in range(j):
            d = d - Lm[j][k] * Lm[j][k]
        Lm[j][j] = d.clamp_min(1e-300).sqrt()
        inv = 1.0 / Lm[j][j]
        for i in range(j + 1, n):
            e = H[:, i, j]
            for k in range(j):
                e = e - Lm[i][k] * Lm[j][k]
            Lm[i][j] = e * inv
    y = [None] * n
    for i in range(n):
        e = g[:, i]
        for k in range(i):
            e = e - Lm[i][k] * y[k]
        y[i] = e / Lm[i][i]
    x = [None] * n
    for i in reversed(range(n)):
        e = y[i]
        for k in range(i + 1, n):
            e = e - Lm[k][i] * x[k]
        x[i] = e / Lm[i][i]
    return torch.stack(x, -1)


def _refine(R, t, X, xn, w, fx, fy, iterations: int):
    """Levenberg-Marquardt on the pixel reprojection error, the pose updated on the left: p <- exp([a]) p + b for a
    step (a, b), whose Jacobian in normalised coordinates is the textbook closed form (no per-point matrices).
    Returns the refined R, t and their cost."""
    N = R.shape[0]
    mu = torch.full((N,), LM_DAMPING, dtype=R.dtype, device=R.device)
    p, x, y, ru, rv, cost = _project(R, t, X, xn, w, fx, fy)
    cost = torch.where(torch.isfinite(cost), cost, torch.full_like(cost, float("inf")))
    for _ in range(iterations):
        z = p[..., 2]
        iz = w / torch.where(z.abs() > 1e-300, z, torch.ones_like(z))
        fxw, fyw = fx * w, fy * w
        zero = torch.zeros_like(z)
        # d(u, v)/d(a, b), (N, L, 6) each
        Ju = torch.stack([-x * y * fxw, (1 + x * x) * fxw, -y * fxw, fx * iz, zero, -x * fx * iz], -1)
        Jv = torch.stack([-(1 + y * y) * fyw, x * y * fyw, x * fyw, zero, fy * iz, -y * fy * iz], -1)
        H = Ju.transpose(1, 2) @ Ju + Jv.transpose(1, 2) @ Jv
        g = (Ju * ru[..., None] + Jv * rv[..., None]).sum(1)
        diag = H.diagonal(dim1=1, dim2=2)
        damped = H + torch.diag_embed(mu[:, None] * diag.clamp_min(1e-12))
        step = -_solve_spd(damped, g)
        rot = rodrigues(step[:, :3])
        R_new = rot @ R
        t_new = (rot @ t[..., None])[..., 0] + step[:, 3:]
        p_new, x_new, y_new, ru_new, rv_new, cost_new = _project(R_new, t_new, X, xn, w, fx, fy)
        better = torch.isfinite(cost_new) & (cost_new < cost)
        b2, b3 = better[:, None], better[:, None, None]
        R, t, p = torch.where(b3, R_new, R), torch.where(b2, t_new, t), torch.where(b3, p_new, p)
        x, y = torch.where(b2, x_new, x), torch.where(b2, y_new, y)
        ru, rv = torch.where(b2, ru_new, ru), torch.where(b2, rv_new, rv)
        cost = torch.where(better, cost_new, cost)
        mu = torch.where(better, mu / LM_SHRINK, mu * LM_GROW).clamp(LM_DAMPING_MIN, LM_DAMPING_MAX)
    return R, t, p, cost


def _best(cost: torch.Tensor, of: torch.Tensor, N: int) -> torch.Tensor:
    """Per frame, the index of its candidate of least cost (the first listed among equals); M where it has none.
    cost (M,) (inf: not valid), of (M,) each candidate's frame."""
    M = len(cost)
    order = torch.sort(cost, stable=True).indices
    first = torch.full((N,), M, dtype=torch.long, device=cost.device)
    first.scatter_reduce_(0, of[order], torch.arange(M, device=cost.device), "amin")
    return torch.cat([order, torch.tensor([M], device=cost.device)])[first]


def _candidates(R, t, of, X, xn, w, fx, fy, iterations):
    """Refine starts (R, t) of frames `of`; their poses (M, 3, 4) and costs (inf where a found point is not in
    front of the camera or anything is not finite)."""
    R, t, p, cost = _refine(R, t, X[of], xn[of], w[of], fx[of, None], fy[of, None], iterations)
    front = ((p[..., 2] > 0) | (w[of] == 0)).all(-1)
    pose = torch.cat([R, t[..., None]], -1)
    valid = front & torch.isfinite(pose).flatten(1).all(-1) & torch.isfinite(cost)
    return pose, torch.where(valid, cost, torch.full_like(cost, float("inf")))


def solve_pnp(uv: torch.Tensor, found: torch.Tensor, points: torch.Tensor, K: torch.Tensor,
              neighbours: torch.Tensor | None = None, iterations: int = LM_ITERATIONS
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """World-to-camera poses of N frames at once, on their device.

    uv (N, L, 2) pixel positions (u = column, v = row; anything where not found), found (N, L) bool, points
    (N, L, 3) the landmarks' world positions, K (N, 3, 3) intrinsics (zero bottom row but the 1; skew allowed).
    neighbours (N, k) long, optional: rows of the same batch whose solutions may seed a frame with few landmarks
    (its video's previous and next frames), -1 for none.
    Returns poses (N, 3, 4) float64 (NaN where not placed) and codes (N,) int8: PLACED, TOO_FEW or FAILED.
    """
    dtype = torch.float64
    N = uv.shape[0]
    count = found.sum(-1)
    enough = count >= MIN_LANDMARKS
    poses = torch.full((N, 3, 4), float("nan"), dtype=dtype, device=uv.device)
    codes = torch.where(enough, FAILED, TOO_FEW).to(torch.int8)
    rows = torch.nonzero(enough)[:, 0]
    if len(rows):
        local = None
        if neighbours is not None:  # neighbours as indices among `rows` (-1 where none or not enough landmarks)
            where = torch.full((N + 1,), -1, dtype=torch.long, device=uv.device)
            where[rows] = torch.arange(len(rows), device=uv.device)
            local = where[torch.where(neighbours < 0, N, neighbours)[rows]]
        pose, placed = _solve_rows(uv[rows].to(dtype), found[rows], points[rows].to(dtype), K[rows].to(dtype),
                                   iterations, local)
        poses[rows] = pose
        codes[rows] = torch.where(placed, PLACED, FAILED).to(torch.int8)
    return poses, codes


def _solve_rows(uv, found, points, K, iterations, neighbours=None):
    """solve_pnp on frames that all have enough landmarks: poses (N, 3, 4) (NaN where not placed), placed (N,)."""
    dtype = uv.dtype
    w = found.to(dtype)
    uv = torch.where(found[..., None], uv, torch.zeros_like(uv))  # NaN times a zero weight is still NaN
    X = torch.where(found[..., None], points, torch.zeros_like(points))
    N = uv.shape[0]
    count = found.sum(-1)
    # normalised image coordinates: K^-1 [u, v, 1] (K upper triangular)
    fx, s, cx, fy, cy = K[:, 0, 0], K[:, 0, 1], K[:, 0, 2], K[:, 1, 1], K[:, 1, 2]
    yn = (uv[..., 1] - cy[:, None]) / fy[:, None]
    xn = torch.stack([(uv[..., 0] - cx[:, None] - s[:, None] * yn) / fx[:, None], yn], -1) * w[..., None]
    frame = torch.arange(N, device=uv.device)
    # pass 1, every frame: its affine start, and its DLT start where it has 6 landmarks or more
    R_a, t_a = _affine_start(xn, X, w)
    dlt_rows = torch.nonzero(count >= 6)[:, 0]
    R_d, t_d = _dlt_start(xn[dlt_rows], X[dlt_rows], w[dlt_rows])
    of = torch.cat([frame, dlt_rows])
    pose, cost = _candidates(torch.cat([R_a, R_d]), torch.cat([t_a, t_d]), of, X, xn, w, fx, fy, iterations)
    best = _best(cost, of, N)
    pose, cost = torch.cat([pose, pose[:1]]), torch.cat([cost, cost.new_full((1,), float("inf"))])
    pose1, cost1 = pose[best], cost[best]
    # pass 2, frames with 4 or 5 landmarks, where the affine start is poor (4 points fit any affine camera exactly)
    # and there is no DLT: the affine start turned by +-FEW_TILTS about the camera's x and y axes, the pass-1
    # solutions of its neighbours, and its own pass-1 solution, each refined longer (their minima are shallow)
    few = torch.nonzero(count < 6)[:, 0]
    if len(few) == 0:
        placed = torch.isfinite(cost1)
        return torch.where(placed[:, None, None], pose1, torch.full_like(pose1, float("nan"))), placed
    tilts = [torch.tensor(v, dtype=dtype, device=uv.device) * angle for angle in FEW_TILTS
             for v in ((1, 0, 0), (-1, 0, 0), (0, 1, 0), (0, -1, 0))]
    tilted = [rodrigues(v).expand(len(few), 3, 3) @ R_a[few] for v in tilts]
    starts_R = [pose1[few, :, :3]] + tilted
    starts_t = [pose1[few, :, 3]] + [_translation_for(R_t, xn[few], X[few], w[few]) for R_t in tilted]
    starts_of = [few] * (1 + len(tilts))
    if neighbours is not None:
        for k in range(neighbours.shape[1]):
            nb = neighbours[few, k]
            use = nb >= 0
            nb_ok = use & torch.isfinite(cost1[nb.clamp_min(0)])
            keep = torch.nonzero(nb_ok)[:, 0]
            starts_R.append(pose1[nb[keep], :, :3])
            starts_t.append(pose1[nb[keep], :, 3])
            starts_of.append(few[keep])
    R0 = torch.cat(starts_R)
    R0 = torch.where(torch.isfinite(R0), R0, torch.eye(3, dtype=dtype, device=uv.device).expand(R0.shape))
    t0 = torch.nan_to_num(torch.cat(starts_t))
    of2 = torch.cat(starts_of)
    pose2, cost2 = _candidates(R0, t0, of2, X, xn, w, fx, fy, FEW_SCREEN_ITERATIONS)
    # the best of each such frame's candidates, then refined for longer: one candidate each, not a dozen
    best = _best(cost2, of2, N)[few]
    best = torch.where(best < len(cost2), best, 0)  # a frame with no valid candidate: any, its cost stays inf
    pose3, cost3 = _candidates(pose2[best, :, :3], pose2[best, :, 3], few, X, xn, w, fx, fy, FEW_ITERATIONS)
    of_all = torch.cat([frame, few])
    pose_all, cost_all = torch.cat([pose1, pose3]), torch.cat([cost1, cost3])
    best = _best(cost_all, of_all, N)
    pose_all = torch.cat([pose_all, pose_all[:1]])
    cost_all = torch.cat([cost_all, cost_all.new_full((1,), float("inf"))])
    pose, cost = pose_all[best], cost_all[best]
    placed = torch.isfinite(cost)
    return torch.where(placed[:, None, None], pose, torch.full_like(pose, float("nan"))), placed
