"""Norms, normalisations and projections onto {x + delta : ||delta||_p <= eps, 0 <= x + delta <= 1}.

Everything works per sample on batches of any shape (B, ...), and is written without host-device
synchronisation on GPUs (no ``.item()``, no data-dependent shapes) so the attacks can call it inside their
loops; on the CPU, where it costs nothing, the exact L1 projection checks whether a partial sort sufficed.
The Linf and L2 versions reproduce the arithmetic of the AutoAttack reference (``pyautoattack``) so that
attacks built on them match it to float precision.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from robust_lightning.devices import host_reads_are_cheap

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


# ------------------------------------------------------------------ piecewise-linear solves on sorted keys
#
# The exact projections (L1 here, FAB's onto a hyperplane) solve a piecewise-linear equation whose kinks
# have to be taken in sorted order, but only as far as the solution reaches: on 32-px test_resnet, fewer than
# 32 of the n = 3072 for most rows of FAB's and Square's projections, up to about a thousand in APGD-L1's steps.
# A full sort of every row is what made them expensive on the CPU, so there only the smallest keys are sorted
# first (a top-k of few keys costs a fraction of a larger one there).

_PREFIX = 32  # keys per row sorted at first on the CPU


def _on_smallest(solve: Callable[..., tuple[Tensor, Tensor]], keys: Tensor, *per_row: Tensor) -> Tensor:
    """``solve(order, *per_row)``, with ``order`` the indices of each row's ``m`` smallest keys (ascending).

    ``solve`` returns its answer per row and whether that answer is complete with the first ``m`` keys. On
    the CPU ``m`` starts at ``_PREFIX`` and the incomplete rows are solved again with 8x more keys (the check
    costs nothing there); on other devices all keys are sorted at once, so that nothing waits for the host.
    """

    def smallest(keys: Tensor, m: int) -> Tensor:
        return torch.topk(keys, m, dim=1, largest=False).indices if m < n else torch.argsort(keys, dim=1)

    n = keys.shape[1]
    m = min(n, _PREFIX) if host_reads_are_cheap(keys) else n
    answer, complete = solve(smallest(keys, m), *per_row)
    while m < n and not bool(complete.all()):
        m = min(n, 8 * m)
        rows = (~complete).nonzero().squeeze(1)
        answer[rows], complete[rows] = solve(smallest(keys[rows], m), *(x[rows] for x in per_row))
    return answer


def _cumsum_from_zero(x: Tensor) -> Tensor:
    """Per row, the sums of the first k entries for k = 0..n (n + 1 columns)."""
    return F.pad(torch.cumsum(x, dim=1), (1, 0))


def _l1_threshold(order: Tensor, negated_kinks: Tensor, eps: Tensor, binding: Tensor) -> tuple[Tensor, Tensor]:
    """``lam`` with ``f(lam) = eps`` from the kinks of ``f`` in ``order`` (the largest first; see below)."""
    kinks_s = -negated_kinks.gather(1, order)
    # walking down: a coordinate leaves zero at a kink of the first half and reaches its cap at one of the second
    shrinking = torch.cumsum(torch.where(order < negated_kinks.shape[1] // 2, 1.0, -1.0), 1)
    f = _cumsum_from_zero(shrinking[:, :-1] * (kinks_s[:, :-1] - kinks_s[:, 1:]))  # f at each kink (0 at the first)
    k = (f <= eps[:, None]).sum(1, keepdim=True) - 1  # the last kink with f <= eps: lam lies just below it
    rate = shrinking.gather(1, k)
    lam = kinks_s.gather(1, k) - (eps[:, None] - f.gather(1, k)) / torch.where(rate > 0, rate, 1.0)
    return lam.squeeze(1), (k.squeeze(1) < order.shape[1] - 1) | ~binding


def l1_projection(x: Tensor, delta: Tensor, eps: float) -> Tensor:
    """Exact Euclidean projection of the perturbation ``delta`` onto {d : ||d||_1 <= eps, 0 <= x + d <= 1}.

    Returns the projected **perturbation** (``x + result`` is the projected point), unlike the reference's
    ``L1_projection``, which returns the correction to add to ``delta``. ``x`` must lie in [0, 1].

    The KKT conditions give, per coordinate, ``d_i = sign(delta_i) * clip(|delta_i| - lam, 0, m_i)``, where
    ``m_i = min(|delta_i|, room_i)`` is what the box allows in the direction of ``delta_i`` (``1 - x_i``
    upwards, ``x_i`` downwards) and ``lam >= 0`` is the smallest value with ``||d||_1 <= eps``.
    ``f(lam) = ||d(lam)||_1`` is continuous, non-increasing and piecewise linear: coordinate i stays at its
    cap ``m_i`` up to ``lam = |delta_i| - m_i``, then shrinks, and is zero from ``|delta_i|`` on. Walking these
    kinks from the largest down, ``f`` grows by the number of shrinking coordinates times the distance; ``lam``
    is where it reaches ``eps`` (exact up to float rounding). Only the largest kinks are sorted (see
    ``_on_smallest``).
    """
    shape = delta.shape
    x_flat, d_flat = x.flatten(1).to(delta.dtype), delta.flatten(1)
    mag = d_flat.abs()
    room = torch.where(d_flat > 0, 1.0 - x_flat, x_flat).clamp(min=0.0)
    cap = torch.minimum(mag, room)  # box-clipped magnitudes: the answer when the ball is inactive
    binding = cap.sum(1) > eps
    negated_kinks = torch.cat((-mag, cap - mag), 1)  # negated: the largest kinks are the smallest keys
    budget = torch.full_like(mag[:, 0], eps)
    lam = torch.where(binding, _on_smallest(_l1_threshold, negated_kinks, negated_kinks, budget, binding), 0.0)
    return (torch.sign(d_flat) * (mag - lam[:, None]).clamp(min=0.0).minimum(cap)).view(shape)


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
