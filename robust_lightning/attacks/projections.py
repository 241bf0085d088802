"""Norms, normalisations and projections onto {x + delta : ||delta||_p <= eps, 0 <= x + delta <= 1}.

Everything works per sample on batches of any shape (B, ...), and is written without host-device
synchronisation (no ``.item()``, no data-dependent shapes) so the attacks can call it inside their loops.
The Linf and L2 versions reproduce the arithmetic of the AutoAttack reference (``pyautoattack``) so that
attacks built on them match it to float precision.
"""

import torch
from torch import Tensor

NORMS = ("Linf", "L2", "L1")


def check_threat_model(norm: str, eps: float) -> None:
    """The argument checks every attack shares (metadata only: no device sync)."""
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; expected one of {NORMS}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _per_sample(v: Tensor, like: Tensor) -> Tensor:
    """Reshape a (B,) tensor to (B, 1, 1, ...) so it broadcasts against ``like``."""
    return v.view(-1, *([1] * (like.dim() - 1)))


def lp_norm(delta: Tensor, norm: str) -> Tensor:
    """Per-sample norm of ``delta`` (shape (B,)); L0 counts the non-zero entries."""
    flat = delta.flatten(1)
    if norm == "Linf":
        return flat.abs().amax(1)
    if norm == "L2":
        return flat.pow(2).sum(1).sqrt()  # same formula as the reference (bit-for-bit agreement)
    if norm == "L1":
        return flat.abs().sum(1)
    if norm == "L0":
        return (flat != 0).sum(1)
    raise ValueError(f"unknown norm {norm!r}; expected one of {NORMS + ('L0',)}")


def normalize(v: Tensor, norm: str) -> Tensor:
    """``v / (||v|| + 1e-12)`` per sample; the small constant keeps zero vectors at zero."""
    return v / (_per_sample(lp_norm(v, norm), v) + 1e-12)


def project_linf(x: Tensor, x_adv: Tensor, eps: float) -> Tensor:
    """Exact projection of ``x_adv`` onto the Linf ball around ``x`` intersected with the [0, 1] box."""
    return torch.clamp(torch.clamp(x_adv, x - eps, x + eps), 0.0, 1.0)


def project_l2(x: Tensor, x_adv: Tensor, eps: float) -> Tensor:
    """Projection onto the L2 ball around ``x``, then clipping to [0, 1] (the reference's scheme).

    Not the exact projection onto the intersection, but the result lies in both sets: with ``x`` in the box,
    clipping moves every coordinate towards ``x`` and so can only shrink the perturbation.
    """
    delta = x_adv - x
    radius = torch.clamp(_per_sample(lp_norm(delta, "L2"), delta), max=eps)
    return torch.clamp(x + normalize(delta, "L2") * radius, 0.0, 1.0)


def l1_projection(x: Tensor, delta: Tensor, eps: float, n_bisect: int = 40) -> Tensor:
    """Exact Euclidean projection of the perturbation ``delta`` onto {d : ||d||_1 <= eps, 0 <= x + d <= 1}.

    Returns the projected **perturbation** (``x + result`` is the projected point), unlike the reference's
    ``L1_projection``, which returns the correction to add to ``delta``. ``x`` must lie in [0, 1].

    The KKT conditions give, per coordinate, ``d_i = sign(delta_i) * clip(|delta_i| - lam, 0, m_i)``, where
    ``m_i = min(|delta_i|, room_i)`` is what the box allows in the direction of ``delta_i`` (``1 - x_i``
    upwards, ``x_i`` downwards) and ``lam >= 0`` is the smallest value with ``||d||_1 <= eps``.
    ``f(lam) = ||d(lam)||_1`` is continuous and non-increasing, so a bisection on ``lam`` with a fixed
    number of steps finds it (no data-dependent control flow, hence no device sync). 40 halvings of
    [0, max |delta_i|] reach the float32 resolution of ``lam``, so the result is exact up to float error;
    we keep the upper end of the bracket, which is feasible: ``||d||_1 <= eps`` as computed.
    """
    shape = delta.shape
    x_flat, d_flat = x.flatten(1).to(delta.dtype), delta.flatten(1)
    mag = d_flat.abs()
    room = torch.where(d_flat > 0, 1.0 - x_flat, x_flat).clamp(min=0.0)
    cap = torch.minimum(mag, room)  # box-clipped magnitudes: the answer when the ball is inactive

    def shrink(lam: Tensor) -> Tensor:
        return (mag - lam[:, None]).clamp(min=0.0).minimum(cap)

    # Invariant: f(lo) > eps >= f(hi) wherever the ball is active (f(max |delta|) = 0).
    lo = torch.zeros_like(mag[:, 0])
    hi = mag.amax(1)
    for _ in range(n_bisect):
        mid = 0.5 * (lo + hi)
        above = shrink(mid).sum(1) > eps
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    # Where the box-clipped delta is already inside the ball, lam = 0 exactly (not a bisection residue).
    lam = torch.where(cap.sum(1) > eps, hi, torch.zeros_like(hi))
    return (torch.sign(d_flat) * shrink(lam)).view(shape)


def project_l1(x: Tensor, x_adv: Tensor, eps: float) -> Tensor:
    """Exact projection of ``x_adv`` onto the L1 ball around ``x`` intersected with the [0, 1] box."""
    return x + l1_projection(x, x_adv - x, eps)


def project(x: Tensor, x_adv: Tensor, norm: str, eps: float) -> Tensor:
    """Project ``x_adv`` onto the ``norm`` ball of radius ``eps`` around ``x`` intersected with [0, 1]."""
    if norm == "Linf":
        return project_linf(x, x_adv, eps)
    if norm == "L2":
        return project_l2(x, x_adv, eps)
    if norm == "L1":
        return project_l1(x, x_adv, eps)
    raise ValueError(f"unknown norm {norm!r}; expected one of {NORMS}")
