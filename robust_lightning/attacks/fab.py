"""Targeted FAB attack (FAB-T; Croce & Hein, ICML 2020) for Linf, L2 and L1, as run by standard AutoAttack.

FAB looks for the adversarial example of smallest norm. At each step it linearises the margin
``z_t - z_y`` (target minus true logit) around the current iterate, projects both the iterate and the
original point onto the hyperplane where the linearised margin is zero intersected with the [0, 1] box
(the minimal-norm projection, computed exactly for each norm), and moves to a convex combination of the
two overshot projections, biased towards the original point (``alpha <= alpha_max``). Whenever the
iterate is misclassified it is recorded if it is the closest so far and pulled back towards the original
point (factor ``beta``). A point is broken when the closest adversarial found is within ``eps``.

It follows the reference (``pyautoattack.fab_base.FABAttack.attack_single_run`` with ``is_targeted=True``,
``fab_projections.projection_{linf,l2,l1}``, AutoAttack 'standard': one restart, no random start,
``n_iter=100``, ``alpha_max=0.1``, ``eta=1.05``, ``beta=0.9``, target ranks 2..10) operation for
operation, so for the same inputs the two agree to float precision (bit for bit on CPU in our tests).
One call attacks one target rank; the ensemble loops over the ranks on the points that are still robust.

Differences in structure, not in results:

* every point stays in the batch for all iterations (the reference attacks only the correctly classified
  ones; here they are masked out and returned as non-robust with ``x_adv = x`` and norm 0);
* the projections run their bisections on every row and pick each row's case with ``torch.where``, where
  the reference indexes the rows of each case (the probes and the arithmetic are the same);
* gradients are taken with respect to the input only, one backward of ``sum(z_t - z_y)`` per iteration;
  parameters' ``.grad`` are never touched and the model's train/eval mode is left to the caller;
* no host-device synchronisation (no ``.item()``, no data-dependent shapes or control flow), also in the
  set-up as long as ``eps`` is a Python number.

Batch composition can change float rounding in the model (e.g. matmul blocking), and FAB's iterates are
sensitive to it, so a borderline point can flip when compared with a reference run on another batch.
"""

import math
from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import Tensor

from .apgd import Model
from .projections import _per_sample, check_count, check_threat_model, lp_norm

_BIG = 1e12  # stands for "never saturates" in the L2/L1 projections (as in the reference)


@dataclass
class FABResult:
    x_adv: Tensor  # closest adversarial found where its norm is <= eps, else x itself (float32)
    robust: Tensor  # bool per point: no adversarial within eps (False for points misclassified on x)
    # float32 per point: norm of the closest adversarial found (may exceed eps); inf where none was found,
    # 0 where x itself is misclassified
    norm: Tensor


# ------------------------------------------------------------------ projections onto hyperplane and box


def _bisect(cond: Tensor, hi: int, n_coords: int) -> Tensor:
    """Per row, the last index ``k`` in ``[0, hi]`` with ``cond[:, k]`` True, for predicates True...False.

    ``ceil(log2(n_coords))`` halvings with ``torch.where`` updates (the reference's probe sequence), so all
    rows are searched at once without synchronising. Rows whose predicate is not of that shape get some
    index in range, which the callers discard.
    """
    lo = torch.zeros(cond.shape[0], dtype=torch.long, device=cond.device)
    up = torch.full_like(lo, hi)
    for _ in range(math.ceil(math.log2(n_coords))):
        mid = (lo + up) // 2
        ok = cond.gather(1, mid[:, None]).squeeze(1)
        lo = torch.where(ok, mid, lo)
        up = torch.where(ok, up, mid)
    return lo


def _orient(t: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Flip the hyperplane ``w.z = b`` so that ``t`` lies on its non-negative side.

    Returns the flipped ``w`` and ``c = w.t - b >= 0``: a move ``d`` reaches the hyperplane when ``w.d = -c``.
    """
    gap = (w * t).sum(1) - b
    side = torch.where(gap >= 0, 1.0, -1.0)
    return w * side[:, None], gap * side


def project_hyperplane_linf(t: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Smallest-Linf ``d`` (rows of (N, n)) with ``w.(t + d) = b`` and ``t + d`` in [0, 1]^n.

    Where the box makes the hyperplane unreachable, ``d`` moves every coordinate to the bound that lowers
    ``|w.(t + d) - b|`` (the best effort, as in the reference). With Linf radius ``lam`` each coordinate
    moves by ``min(lam, room_i)`` towards its bound, so ``w.d(lam)`` is piecewise linear in ``lam`` with
    kinks at the rooms; sorting the rooms (largest first) and bisecting finds the piece that hits ``b``.
    """
    w, c = _orient(t, w, b)  # w.z has to decrease by c
    moves = w != 0
    up = (w < 0).float()  # coordinates that move up (to 1), the others move down (to 0)
    d_box = (up - t) * moves.float()  # the full move to the bound
    room = up - t * (2 * up - 1)  # |move to the bound|: 1 - t upwards, t downwards
    desc = torch.argsort(room, dim=1).flip(1)  # the reference's ascending sort, flipped: ties order alike

    need = -c  # required change of w.z (<= 0)
    full = (w * d_box).sum(1)  # change with every coordinate at its bound
    w_desc = w.gather(1, desc)
    s = torch.cumsum(w_desc.abs(), dim=1)
    sb = torch.cumsum(-w_desc * d_box.gather(1, desc), dim=1) + full[:, None]
    # reach[:, k]: w.d(lam) at lam = the k-th largest room (the k+1 largest unsaturated, the rest at bounds).
    reach = sb - s * room.gather(1, desc)

    no_saturation = need - reach[:, -1] > 0  # reachable before any coordinate hits its bound
    partial = (need - full > 0) & ~no_saturation
    k = _bisect(need[:, None] - reach > 0, w.shape[1] - 1, w.shape[1])[:, None]

    lam = torch.clamp_min((need - sb[:, -1]) / (-s[:, -1]), min=0)[:, None]
    d_free = (2 * up - 1) * lam
    lam_k = torch.clamp_min((need[:, None] - sb.gather(1, k)) / (-s.gather(1, k)), min=0)
    d_partial = torch.min(lam_k, d_box) * up + torch.max(-lam_k, d_box) * (1 - up)

    d = torch.where(no_saturation[:, None], d_free, torch.where(partial[:, None], d_partial, d_box))
    return d * moves.float()


def project_hyperplane_l2(t: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Smallest-L2 ``d`` with ``w.(t + d) = b`` and ``t + d`` in [0, 1]^n (best effort where unreachable).

    The solution is ``d_i = clip(-lam * w_i)`` to the box for some ``lam >= 0``; coordinate ``i`` saturates
    at ``lam = r_i``. Sorting the ``r_i`` makes ``w.d(lam)`` piecewise linear, and bisection finds the piece.
    """
    w, c = _orient(t, w, b)  # c = w.t - b >= 0: w.d must equal -c
    tiny = w.abs() < 1e-8
    r = torch.max(t / w, (t - 1) / w).clamp(min=-_BIG, max=_BIG)
    r = torch.where(tiny, _BIG, r)  # (near-)zero weights never saturate, and their 0/0 NaNs are dropped
    r = torch.where(r == -_BIG, _BIG, r)  # (r >= 0 for t in the box; kept from the reference)
    rs, order = torch.sort(r, dim=1)
    rs_next = F.pad(rs[:, 1:], (0, 1))
    rs = torch.where(rs == _BIG, 0.0, rs)
    rs_next = torch.where(rs_next == _BIG, 0.0, rs_next)

    w2 = (w**2).gather(1, order)
    w2_total = w2.sum(dim=1, keepdim=True)
    w2_free = w2_total - torch.cumsum(w2, dim=1)  # squared weight of the coordinates not yet saturated
    d_box = -(r * w) * (w.abs() > 1e-8).float()  # every coordinate at its bound
    # s[:, k]: w.d(lam) at lam = rs[:, k] (and one trailing value past the last kink).
    start = -w2_total * rs[:, 0:1]
    s = torch.cat((start, torch.cumsum((-rs_next + rs) * w2_free, dim=1) + start), 1)

    no_saturation = s[:, 0] + c < 0
    unreachable = (d_box * w).sum(dim=1) + c > 0
    partial = ~(no_saturation | unreachable)
    k = _bisect(s[:, :-1] + c[:, None] > 0, w.shape[1] - 1, w.shape[1])[:, None]

    d_free = -(c / w2_total.squeeze(-1))[:, None] * w  # plain projection onto the hyperplane
    free_k = w2_free.gather(1, k)
    lam = (s.gather(1, k) + c[:, None]) / free_k + rs.gather(1, k)
    lam = torch.where(free_k == 0, 0.0, lam)
    saturated = (lam > r).float()
    d_partial = d_box * saturated - lam * w * (1 - saturated)

    d = torch.where(no_saturation[:, None], d_free, torch.where(partial[:, None], d_partial, d_box))
    return d * (w.abs() > 1e-8).float()


def project_hyperplane_l1(t: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Smallest-L1 ``d`` with ``w.(t + d) = b`` and ``t + d`` in [0, 1]^n (best effort where unreachable).

    L1 moves the coordinates with the largest ``|w_i|`` first, each to its bound, until the next one only
    needs a partial move; the cumulative change along that order is bisected.
    """
    w, c = _orient(t, w, b)  # w.d must equal -c <= 0
    order = torch.argsort((1 / w).abs().clamp_max(_BIG), dim=1)  # largest |w_i| first
    positions = torch.arange(w.shape[1], device=w.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)  # inverse permutation: rank of each coordinate

    d_box = (-t + (w < 0).float()) * (w != 0).float()  # every coordinate at the bound that lowers w.z
    gain = torch.min(-w * t, w * (1 - t)).gather(1, order)  # change of w.z of each full move (<= 0)
    s = torch.cumsum(torch.cat((c[:, None], gain), 1), dim=1)  # remaining gap after the first k full moves

    reachable = s[:, -1] < 0
    k = _bisect(s > 0, w.shape[1], w.shape[1])  # k full moves leave a positive gap, k + 1 overshoot
    last = order.gather(1, k[:, None])  # the coordinate that only moves partially
    step = -s.gather(1, k[:, None]) / w.gather(1, last)
    d_partial = (d_box * (rank < k[:, None]).float()).scatter(1, last, step)

    d = torch.where(reachable[:, None], d_partial, d_box)
    return d * (w.abs() > 1e-8).float()


_PROJECTIONS = {"Linf": project_hyperplane_linf, "L2": project_hyperplane_l2, "L1": project_hyperplane_l1}


# ------------------------------------------------------------------------------------------- attack


def _margin_and_grad(model: Model, x: Tensor, y: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``z_t - z_y`` per point and its gradient w.r.t. the input: one forward, one backward, input only."""
    with torch.enable_grad():  # the caller may be in no_grad (validation, evaluation)
        x_req = x.detach().requires_grad_(True)
        z = model(x_req).float()
        margin = z.gather(1, target[:, None]).squeeze(1) - z.gather(1, y[:, None]).squeeze(1)
        (grad,) = torch.autograd.grad(margin.sum(), x_req)  # summed: each point gets its own gradient
    return margin.detach(), grad.detach()


def _predict(model: Model, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x).argmax(1)


def fab_targeted(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str = "Linf",
    eps: float,
    n_iter: int = 100,
    target_rank: int | Tensor = 2,
    alpha_max: float = 0.1,
    eta: float = 1.05,
    beta: float = 0.9,
    logits_clean: Tensor | None = None,
) -> FABResult:
    """Targeted FAB on the batch ``x`` (values in [0, 1]) with int64 labels ``y``.

    Args:
        model: callable mapping a batch to logits (B, C); called as is (mode, autocast: the caller's).
        norm: "Linf", "L2" or "L1".
        eps: a point is broken when an adversarial example within ``eps`` is found.
        n_iter: FAB steps (each: one forward + backward for the step, one forward to check the iterate).
        target_rank: the target is the class ranked ``target_rank`` by the clean logits (2 = the most
            likely class after the top one; standard AutoAttack runs ranks 2..10); an int64 tensor (B,)
            gives each point its own rank (several ranks of one point attacked in one batch).
        alpha_max, eta, beta: FAB's bias towards the original point, overshoot and backward step.
        logits_clean: the model's logits on ``x``, if already computed (saves one forward).

    Returns:
        :class:`FABResult`. ``x_adv`` is the closest adversarial found where it is within ``eps`` and passes
        a final check by the model (as in the reference), else ``x``.
    """
    check_threat_model(norm, eps)
    check_count("n_iter", n_iter, 1)
    if x.dim() < 2 or y.shape != x.shape[:1] or y.dtype != torch.int64:
        raise ValueError(f"expected x (B, ...) and int64 y (B,), got {tuple(x.shape)} and {y.dtype} {tuple(y.shape)}")

    x = x.detach().float()
    batch = x.shape[0]
    if logits_clean is None:
        with torch.no_grad():
            logits_clean = model(x)
    logits_clean = logits_clean.detach().float()
    n_classes = logits_clean.shape[1]
    ranks = torch.as_tensor(target_rank, device=x.device).expand(batch)
    if isinstance(target_rank, int) and not 2 <= target_rank <= n_classes:  # a tensor is not checked: no sync
        raise ValueError(f"target_rank must be in [2, {n_classes}], got {target_rank}")
    # Same sort as the reference, so ties between logits pick the same target.
    target = logits_clean.sort(dim=1).indices.gather(1, (n_classes - ranks)[:, None]).squeeze(1)
    attacked = logits_clean.argmax(1) == y  # only correctly classified points are attacked

    project = _PROJECTIONS[norm]
    x0 = x.flatten(1)
    x1 = x.clone()
    x_best = x.clone()
    best_norm = torch.full((batch,), float("inf"), device=x.device)

    for _ in range(n_iter):
        margin, grad = _margin_and_grad(model, x1, y, target)
        # Linearised decision boundary {z : w.z = b}, i.e. margin + w.(z - x1) = 0.
        w = grad.flatten(1)
        b = (w * x1.flatten(1)).sum(1) - margin
        # Project the iterate and the original point in one batched call.
        d = project(torch.cat((x1.flatten(1), x0)), torch.cat((w, w)), torch.cat((b, b)))
        size = lp_norm(d, norm).clamp_min(1e-8)
        d_iter, d_orig = d[:batch].view_as(x), d[batch:].view_as(x)
        # Bias towards the original point, more so when its projection is the closer one.
        alpha = _per_sample((size[:batch] / (size[:batch] + size[batch:])).clamp(0.0, alpha_max), x)
        x1 = ((x1 + eta * d_iter) * (1 - alpha) + (x + d_orig * eta) * alpha).clamp(0.0, 1.0)

        # Keep the closest adversarial so far; adversarial iterates are pulled back towards x.
        is_adv = _predict(model, x1) != y
        dist = lp_norm(x1 - x, norm)
        closer = is_adv & attacked & (dist < best_norm)
        x_best = torch.where(_per_sample(closer, x), x1, x_best)
        best_norm = torch.where(closer, dist, best_norm)
        x1 = torch.where(_per_sample(is_adv, x), x + (x1 - x) * beta, x1)

    # Accept within eps only, after re-checking the prediction at the stored point (as the reference does).
    broken = attacked & (best_norm <= eps) & (_predict(model, x_best) != y)
    return FABResult(
        x_adv=torch.where(_per_sample(broken, x), x_best, x),
        robust=attacked & ~broken,
        norm=torch.where(attacked, best_norm, torch.zeros_like(best_norm)),
    )
