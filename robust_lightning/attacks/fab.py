"""FAB (Croce & Hein, ICML 2020) for Linf, L2 and L1: targeted (FAB-T), as run by standard AutoAttack, and
untargeted (:func:`fab_untargeted`), as run by its version "plus".

FAB looks for the adversarial example of smallest norm. At each step it linearises the margin
``z_t - z_y`` (target minus true logit) around the current iterate, projects both the iterate and the
original point onto the hyperplane where the linearised margin is zero intersected with the [0, 1] box
(the minimal-norm projection, computed exactly for each norm), and moves to a convex combination of the
two overshot projections, biased towards the original point (``alpha <= alpha_max``). Whenever the
iterate is misclassified it is recorded if it is the closest so far and pulled back towards the original
point (factor ``beta``). A point is broken when the closest adversarial found is within ``eps``.

It follows the reference (``pyautoattack.fab_base.FABAttack.attack_single_run`` with ``is_targeted=True``,
``fab_projections.projection_{linf,l2,l1}``, AutoAttack 'standard': one restart, no random start,
``n_iter=100``, ``alpha_max=0.1``, ``eta=1.05``, ``beta=0.9``, target ranks 2..10) step for step, so for
the same inputs the two agree to float rounding. One call attacks one target rank, or one rank per point.

Differences in structure, not in results:

* every point stays in the batch for all iterations (the reference attacks only the correctly classified
  ones; here they are masked out and returned as non-robust with ``x_adv = x`` and norm 0);
* the projections compute the same minimal-norm solutions differently: each row's case is picked with
  ``torch.where`` where the reference indexes the rows of each case, the Linf and L2 ones share one
  water-filling solver, and on the CPU only the smallest keys of the sort are sorted (see below);
* gradients are taken with respect to the input only, one backward of ``sum(z_t - z_y)`` per iteration;
  parameters' ``.grad`` are never touched and the model's train/eval mode is left to the caller;
* no host-device synchronisation on GPUs (no ``.item()``, no data-dependent shapes or control flow), also
  in the set-up as long as ``eps`` is a Python number; on the CPU, where it costs nothing, the projections
  check whether a partial sort sufficed.

Batch composition can change float rounding in the model (e.g. matmul blocking), and FAB's iterates are
sensitive to it, so a borderline point can flip when compared with a reference run on another batch.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from .apgd import Model
from .projections import _cumsum_from_zero, _on_smallest, _per_sample, check_count, check_threat_model, lp_norm

_BIG = 1e12  # stands for "never saturates" in the L2/L1 projections (as in the reference)


@dataclass
class FABResult:
    x_adv: Tensor  # closest adversarial found where its norm is <= eps, else x itself (float32)
    robust: Tensor  # bool per point: no adversarial within eps (False for points misclassified on x)
    # float32 per point: norm of the closest adversarial found (may exceed eps); inf where none was found,
    # 0 where x itself is misclassified
    norm: Tensor


# ------------------------------------------------------------------ projections onto hyperplane and box
#
# Each projection orders the coordinates (by the radius where they saturate for Linf and L2, by weight for
# L1), but only as far as its solution reaches (``_on_smallest``): few coordinates saturate or move. Orders
# agree with the reference's up to ties, which change float rounding only.


def _orient(t: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Flip the hyperplane ``w.z = b`` so that ``t`` lies on its non-negative side.

    Returns the flipped ``w`` and ``c = w.t - b >= 0``: a move ``d`` reaches the hyperplane when ``w.d = -c``.
    """
    gap = (w * t).sum(1) - b
    side = torch.where(gap >= 0, 1.0, -1.0)
    return w * side[:, None], gap * side


def _water_fill_radius(
    order: Tensor, rate: Tensor, radius: Tensor, c: Tensor, reachable: Tensor
) -> tuple[Tensor, Tensor]:
    """``lam`` with ``sum_i rate_i * min(lam, radius_i) = c``, from the radii in ``order`` (the smallest)."""
    rate_s, radius_s = rate.gather(1, order), radius.gather(1, order)
    saturated_gap = _cumsum_from_zero(rate_s * radius_s)  # closed by the k smallest radii, k = 0..m
    # (clamped: rounding must not leave a negative rate, which huge radii would turn into a large gap)
    free_rate = (rate.sum(1, keepdim=True) - _cumsum_from_zero(rate_s)).clamp_min(0)  # of the other coordinates
    # The gap closed at lam = the k-th smallest radius; it is below c for the radii lam passes.
    closed = saturated_gap[:, :-1] + radius_s * free_rate[:, :-1]
    k = (closed < c[:, None]).sum(1, keepdim=True)
    free_k = free_rate.gather(1, k)
    lam = (c[:, None] - saturated_gap.gather(1, k)) / torch.where(free_k > 0, free_k, 1.0)
    return lam, (k.squeeze(1) < order.shape[1]) | ~reachable


def _water_fill(w: Tensor, v: Tensor, radius: Tensor, c: Tensor, reachable: Tensor) -> Tensor:
    """The move ``d_i = -v_i * min(lam, radius_i)`` with ``w.d = -c`` (``v_i w_i >= 0``) in reachable rows,
    ``d_i = -v_i * radius_i`` (every coordinate saturated) in the others.

    ``-w.d(lam) = sum_i v_i w_i min(lam, radius_i)`` is piecewise linear and increasing in ``lam``, with a kink
    where a coordinate saturates; with the radii sorted, the piece that reaches ``c`` follows from cumulative
    sums.
    """
    lam = _on_smallest(_water_fill_radius, radius, v * w, radius, c, reachable)
    return -v * torch.where(reachable[:, None], torch.minimum(lam, radius), radius)


def project_hyperplane_linf(t: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Smallest-Linf ``d`` (rows of (N, n)) with ``w.(t + d) = b`` and ``t + d`` in [0, 1]^n.

    Where the box makes the hyperplane unreachable, ``d`` moves every coordinate to the bound that lowers
    ``|w.(t + d) - b|`` (the best effort, as in the reference). With Linf radius ``lam`` each coordinate
    moves by ``min(lam, room_i)`` towards that bound.
    """
    w, c = _orient(t, w, b)  # w.z has to decrease by c
    up = w < 0  # coordinates that move up (to 1); the others move down (to 0)
    room = torch.where(up, 1 - t, t)
    reachable = c < (w.abs() * room).sum(1)
    return _water_fill(w, torch.sign(w), room, c, reachable)


def project_hyperplane_l2(t: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Smallest-L2 ``d`` with ``w.(t + d) = b`` and ``t + d`` in [0, 1]^n (best effort where unreachable).

    The solution is ``d_i = -lam * w_i`` clipped to the box: coordinate ``i`` saturates at ``lam = r_i``.
    """
    w, c = _orient(t, w, b)  # w.d must equal -c
    moves = w.abs() > 1e-8  # as in the reference: smaller weights never saturate and do not move
    r = torch.max(t / w, (t - 1) / w).clamp(min=-_BIG, max=_BIG)
    r = torch.where(moves & (r != -_BIG), r, _BIG)  # (r >= 0 for t in the box)
    reachable = c <= torch.where(moves, w * w * r, 0.0).sum(1)
    return torch.where(moves, _water_fill(w, w, r, c, reachable), 0.0)


def _greedy_l1(
    order: Tensor, t: Tensor, w: Tensor, c: Tensor, d_box: Tensor, gain: Tensor, reachable: Tensor
) -> tuple[Tensor, Tensor]:
    """Full moves along ``order`` until the next coordinate only needs a partial one (see below)."""
    gap = torch.cumsum(torch.cat((c[:, None], gain.gather(1, order)), 1), 1)  # after k full moves, k = 0..m
    k = ((gap > 0).sum(1, keepdim=True) - 1).clamp(0, order.shape[1] - 1)  # full moves before the partial one
    last = order.gather(1, k)
    first_k = torch.arange(order.shape[1], device=order.device) < k
    d = torch.zeros_like(t).scatter(1, order, torch.where(first_k, d_box.gather(1, order), 0.0))
    d = d.scatter(1, last, -gap.gather(1, k) / w.gather(1, last))
    return d, (gap[:, -1] <= 0) | ~reachable


def project_hyperplane_l1(t: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Smallest-L1 ``d`` with ``w.(t + d) = b`` and ``t + d`` in [0, 1]^n (best effort where unreachable).

    L1 moves the coordinates with the largest ``|w_i|`` first, each to its bound, until the next one only
    needs a partial move.
    """
    w, c = _orient(t, w, b)  # w.d must equal -c <= 0
    d_box = torch.where(w != 0, (w < 0).float() - t, 0.0)  # every coordinate at the bound that lowers w.z
    gain = torch.min(-w * t, w * (1 - t))  # change of w.z of each full move (<= 0)
    reachable = c + gain.sum(1) < 0
    key = (1 / w).abs().clamp_max(_BIG)  # the reference's key: largest |w_i| first
    d = torch.where(reachable[:, None], _on_smallest(_greedy_l1, key, t, w, c, d_box, gain, reachable), d_box)
    return torch.where(w.abs() > 1e-8, d, 0.0)


_PROJECTIONS = {"Linf": project_hyperplane_linf, "L2": project_hyperplane_l2, "L1": project_hyperplane_l1}


# ------------------------------------------------------------------------------------------- attack


def _margin_and_grad(model: Model, x: Tensor, y: Tensor, *, target: Tensor) -> tuple[Tensor, Tensor]:
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


def _checked_inputs(
    model: Model, x: Tensor, y: Tensor, norm: str, eps: float, n_iter: int, logits_clean: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The arguments checked; ``x`` as float32 and the clean logits (one forward unless given), detached."""
    check_threat_model(norm, eps)
    check_count("n_iter", n_iter, 1)
    if x.dim() < 2 or y.shape != x.shape[:1] or y.dtype != torch.int64:
        raise ValueError(f"expected x (B, ...) and int64 y (B,), got {tuple(x.shape)} and {y.dtype} {tuple(y.shape)}")
    x = x.detach().float()
    if logits_clean is None:
        with torch.no_grad():
            logits_clean = model(x)
    return x, logits_clean.detach().float()


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
    x, logits_clean = _checked_inputs(model, x, y, norm, eps, n_iter, logits_clean)
    batch = x.shape[0]
    n_classes = logits_clean.shape[1]
    if isinstance(target_rank, torch.Tensor):
        ranks = target_rank.to(x.device).expand(batch)
    else:  # a fill on the device: as_tensor would copy the int from the host, which waits for the device (CUDA)
        ranks = torch.full((batch,), target_rank, dtype=torch.long, device=x.device)
    if isinstance(target_rank, int) and not 2 <= target_rank <= n_classes:  # a tensor is not checked: no sync
        raise ValueError(f"target_rank must be in [2, {n_classes}], got {target_rank}")
    # Same sort as the reference, so ties between logits pick the same target.
    target = logits_clean.sort(dim=1).indices.gather(1, (n_classes - ranks)[:, None]).squeeze(1)
    attacked = logits_clean.argmax(1) == y  # only correctly classified points are attacked

    x_best, best_norm = _fab_iterations(
        model, x, y, x.clone(), attacked, partial(_margin_and_grad, target=target), norm, n_iter, alpha_max, eta, beta
    )
    return _accepted(model, x, y, attacked, x_best, best_norm, norm, eps)


def _closest_boundary(model: Model, x: Tensor, y: Tensor, *, norm: str) -> tuple[Tensor, Tensor]:
    """Untargeted FAB's boundary: of the linearised boundaries between the true class and each other class, the
    closest in the norm (the margin's size over its gradient's dual norm); its margin and input gradient.

    It takes the gradient of every logit: one backward per class (the reference's
    ``get_diff_logits_grads_batch``), which is what makes untargeted FAB costly with many classes."""
    with torch.enable_grad():
        x_req = x.detach().requires_grad_(True)
        z = model(x_req).float()
        grads = torch.stack(
            [torch.autograd.grad(z[:, k].sum(), x_req, retain_graph=k < z.shape[1] - 1)[0] for k in range(z.shape[1])],
            dim=1,
        ).flatten(2)  # (B, C, n)
    z = z.detach()
    rows = torch.arange(len(y), device=y.device)
    margins = z - z[rows, y][:, None]
    slopes = grads - grads[rows, y][:, None]
    dual: Callable[[Tensor], Tensor] = {
        "Linf": lambda g: g.abs().sum(2),
        "L2": lambda g: g.norm(dim=2),
        "L1": lambda g: g.abs().amax(2),
    }[norm]
    distance = margins.abs() / (1e-12 + dual(slopes))
    distance[rows, y] = float("inf")  # the true class has no boundary with itself
    closest = distance.argmin(1)
    return margins[rows, closest], slopes[rows, closest].view_as(x)


def fab_untargeted(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str = "Linf",
    eps: float,
    n_iter: int = 100,
    random_start: bool | Tensor = False,
    generator: torch.Generator | None = None,
    alpha_max: float = 0.1,
    eta: float = 1.05,
    beta: float = 0.9,
    logits_clean: Tensor | None = None,
) -> FABResult:
    """Untargeted FAB ("fab" in AutoAttack's version "plus") on the batch ``x`` with int64 labels ``y``: each step
    goes to the closest linearised decision boundary of any class (:func:`_closest_boundary`), and otherwise as
    :func:`fab_targeted` (the reference's ``attack_single_run`` with ``is_targeted=False``).

    ``random_start`` (a bool, or one per point): start at a random point at half of ``eps`` from ``x``, as the
    reference's restarts after the first do, drawn with ``generator``.
    """
    x, logits_clean = _checked_inputs(model, x, y, norm, eps, n_iter, logits_clean)
    attacked = logits_clean.argmax(1) == y
    x1 = x.clone()
    if isinstance(random_start, Tensor):
        x1 = torch.where(_per_sample(random_start.to(x.device), x), _random_start(x, norm, eps, generator), x1)
    elif random_start:
        x1 = _random_start(x, norm, eps, generator)
    x_best, best_norm = _fab_iterations(
        model, x, y, x1, attacked, partial(_closest_boundary, norm=norm), norm, n_iter, alpha_max, eta, beta
    )
    return _accepted(model, x, y, attacked, x_best, best_norm, norm, eps)


def _random_start(x: Tensor, norm: str, eps: float, generator: torch.Generator | None) -> Tensor:
    """The reference's random start of FAB's restarts: a random direction scaled to half of ``eps``."""
    device = generator.device if generator is not None else x.device
    if norm == "Linf":
        t = (2 * torch.rand(x.shape, generator=generator, device=device) - 1).to(x.device)
    else:
        t = torch.randn(x.shape, generator=generator, device=device).to(x.device)
    return (x + 0.5 * eps * t / _per_sample(lp_norm(t, norm), x)).clamp(0.0, 1.0)


def _fab_iterations(
    model: Model,
    x: Tensor,
    y: Tensor,
    x1: Tensor,
    attacked: Tensor,
    boundary: Callable[[Model, Tensor, Tensor], tuple[Tensor, Tensor]],
    norm: str,
    n_iter: int,
    alpha_max: float,
    eta: float,
    beta: float,
) -> tuple[Tensor, Tensor]:
    """FAB's steps from the iterate ``x1``: (the closest adversarial found, its norm; inf where none).
    ``boundary(model, x1, y)`` gives the margin whose linearisation is the decision boundary stepped to, and its
    input gradient."""
    batch = x.shape[0]
    project = _PROJECTIONS[norm]
    x0 = x.flatten(1)
    x_best = x.clone()
    best_norm = torch.full((batch,), float("inf"), device=x.device)

    for _ in range(n_iter):
        margin, grad = boundary(model, x1, y)
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
    return x_best, best_norm


def _accepted(
    model: Model, x: Tensor, y: Tensor, attacked: Tensor, x_best: Tensor, best_norm: Tensor, norm: str, eps: float
) -> FABResult:
    """Accept within eps only, after re-checking the prediction at the stored point (as the reference does)."""
    broken = attacked & (best_norm <= eps) & (_predict(model, x_best) != y)
    return FABResult(
        x_adv=torch.where(_per_sample(broken, x), x_best, x),
        robust=attacked & ~broken,
        norm=torch.where(attacked, best_norm, torch.zeros_like(best_norm)),
    )
