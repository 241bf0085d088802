"""Auto-PGD (Croce & Hein, ICML 2020) for Linf, L2 and L1 (Croce & Hein, ICCV 2021), without Lightning.

One implementation serves adversarial training (Singh et al.: 2 steps, Linf, no random start, soft-target
cross-entropy, the highest-loss iterate) and evaluation (the AutoAttack ensemble is built on top of
:func:`apgd`: restarts via ``generator``, targeted runs via ``loss="dlr-targeted"`` + ``y_target``, the L1
eps schedule via ``x_init`` + ``step_size``, points broken in one run not attacked in the next via ``robust``,
and broken points leaving a run early via ``exit_broken``).

It follows the reference implementation (``pyautoattack.autopgd_base.APGDAttack.attack_single_run``)
step for step, including its indexing quirks, so the two agree to float precision for the same start.
Design constraints:

* gradients are taken with respect to the input only (``torch.autograd.grad``), so parameters' ``.grad``
  are never touched; the model's train/eval mode is left to the caller;
* no host-device synchronisation in the iteration loop (per-point decisions are ``torch.where`` masks,
  control flow depends on Python integers only; ``exit_broken`` reads back after iterations 1, 2, 4, 8, ...
  only), so it does not stall a CUDA stream; the set-up does not
  synchronise either as long as ``eps`` and ``step_size`` are Python numbers and a ``generator`` lives on
  the data's device (a CPU generator with CUDA data costs one host-to-device copy of the start);
* perturbations and losses are float32 even when the caller runs the model under bf16/fp16 autocast.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from robust_lightning.devices import host_reads_are_cheap

from .projections import (
    _per_sample,
    check_count,
    check_threat_model,
    l1_projection,
    lp_norm,
    normalize,
    project,
)

LOSSES = ("ce", "dlr", "dlr-targeted")

Model = Callable[[Tensor], Tensor]
StopPoint = Callable[[], None]  # called inside an attack where it may stop; it raises to stop (a job's stop signal)
STOP_CHECK_GRADIENT_PASSES = 10  # a run asks its stop_point every this many passes (iterations times eot_iter)


@dataclass
class APGDResult:
    x_best: Tensor  # highest-loss iterate per point (what adversarial training uses)
    loss_best: Tensor  # its loss (float32, per point)
    x_adv: Tensor  # last misclassified iterate per point (the start point where never misclassified)
    robust: Tensor  # bool per point: correctly classified at every evaluated iterate (incl. the start)
    logits_last: Tensor  # logits of the last iterate (float32 and detached, unless from last_forward)
    logits_start: Tensor  # logits of the starting point (the clean images without random start / x_init)
    best_is_last: Tensor  # bool per point: x_best is the last iterate
    # bool per point: the input gradient at the start is zero everywhere (the reference's zero_gradients check,
    # which it makes at every APGD start; read here from the gradient APGD computes anyway, on the device)
    zero_gradient: Tensor | None = None


# ----------------------------------------------------------------------------------------------- losses


def dlr_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Difference of Logits Ratio: ``-(z_y - max_{i != y} z_i) / (z_pi1 - z_pi3 + 1e-12)`` per sample."""
    if logits.shape[1] < 3:
        raise ValueError(f"the DLR loss needs at least 3 classes, got {logits.shape[1]}")
    z = logits.float()
    z_y = z.gather(1, y[:, None]).squeeze(1)
    z_other = z.scatter(1, y[:, None], float("-inf")).amax(1)
    top = z.topk(3, dim=1).values
    return -(z_y - z_other) / (top[:, 0] - top[:, 2] + 1e-12)


def dlr_targeted_loss(logits: Tensor, y: Tensor, y_target: Tensor) -> Tensor:
    """Targeted DLR: ``-(z_y - z_t) / (z_pi1 - (z_pi3 + z_pi4) / 2 + 1e-12)`` per sample."""
    if logits.shape[1] < 4:
        raise ValueError(f"the targeted DLR loss needs at least 4 classes, got {logits.shape[1]}")
    z = logits.float()
    z_y = z.gather(1, y[:, None]).squeeze(1)
    z_t = z.gather(1, y_target[:, None]).squeeze(1)
    top = z.topk(4, dim=1).values
    return -(z_y - z_t) / (top[:, 0] - 0.5 * (top[:, 2] + top[:, 3]) + 1e-12)


def per_sample_loss(logits: Tensor, y: Tensor, loss: str = "ce", y_target: Tensor | None = None) -> Tensor:
    """The attack's loss per sample, in float32 whatever the logits' dtype (e.g. bf16 under autocast).

    ``y`` holds int64 labels (B,) or, for ``"ce"`` only, float probability targets (B, C) (MixUp/CutMix,
    label smoothing). Use it on ``APGDResult.logits_last`` to get the loss of the last iterate.
    """
    z = logits.float()
    if loss == "ce":
        # With (B, C) float targets this is the soft cross-entropy -sum_c p_c log softmax(z)_c.
        return F.cross_entropy(z, y.float() if y.is_floating_point() else y, reduction="none")
    if loss == "dlr":
        return dlr_loss(z, y)
    if loss == "dlr-targeted":
        assert y_target is not None, "the targeted DLR loss needs y_target"
        return dlr_targeted_loss(z, y, y_target)
    raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")


def predicted_correct(logits: Tensor, y: Tensor) -> Tensor:
    """Bool per sample: argmax of the logits equals the label (for soft targets: the targets' argmax)."""
    label = y.argmax(1) if y.dim() == 2 else y
    return logits.argmax(1) == label


# ------------------------------------------------------------------------------------ shared helpers


def _validate(x: Tensor, y: Tensor, norm: str, eps: float, n_iter: int, loss: str, y_target: Tensor | None) -> None:
    """Argument checks that only look at metadata (shapes, dtypes), so they cost no device sync."""
    check_threat_model(norm, eps)
    check_count("n_iter", n_iter, 1)
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")
    if x.dim() < 2:
        raise ValueError(f"x must be a batch (B, ...), got shape {tuple(x.shape)}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x and y have different batch sizes: {x.shape[0]} and {y.shape[0]}")
    soft = y.is_floating_point()
    if soft and y.dim() != 2:
        raise ValueError(f"soft targets must have shape (B, C), got {tuple(y.shape)}")
    if not soft and (y.dim() != 1 or y.dtype != torch.int64):
        raise ValueError(f"labels must be int64 of shape (B,), got {y.dtype} of shape {tuple(y.shape)}")
    if loss != "ce" and soft:
        raise ValueError(f"loss {loss!r} needs hard int64 labels of shape (B,); soft targets work with 'ce' only")
    if loss == "dlr-targeted":
        if y_target is None:
            raise ValueError("loss 'dlr-targeted' needs y_target, the int64 target classes (B,)")
        if y_target.shape != y.shape or y_target.is_floating_point():
            raise ValueError(
                f"y_target must be int64 of shape {tuple(y.shape)}, got {y_target.dtype} of shape "
                f"{tuple(y_target.shape)}"
            )
    elif y_target is not None:
        raise ValueError(f"y_target is only used with loss 'dlr-targeted', not {loss!r}")


def _generator(generator: torch.Generator | int | None, device: torch.device) -> torch.Generator | None:
    """A seed becomes a fresh generator on the data's device; None means the global RNG."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return torch.Generator(device=device).manual_seed(int(generator))


def _sample(kind: str, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """``rand``/``randn`` shaped like ``like``, drawn on the generator's device (a CPU generator may serve
    CUDA data) and moved to the data's device."""
    fn = torch.rand if kind == "rand" else torch.randn
    device = generator.device if generator is not None else like.device
    return fn(like.shape, generator=generator, device=device, dtype=torch.float32).to(like.device)


def random_start_point(x: Tensor, norm: str, eps: float, generator: torch.Generator | None = None) -> Tensor:
    """The reference's random starting point (before clipping to [0, 1]).

    Linf: ``x + eps * t / ||t||_inf`` with t uniform in [-1, 1]; L2: ``x + eps * t / ||t||_2`` with t
    Gaussian; L1: a Gaussian perturbation projected onto the L1 ball intersected with the box.
    """
    if norm == "Linf":
        return x + eps * normalize(2 * _sample("rand", x, generator) - 1, "Linf")
    if norm == "L2":
        return x + eps * normalize(_sample("randn", x, generator), "L2")
    return x + l1_projection(x, _sample("randn", x, generator), eps)


def input_gradient(
    model: Model, x_adv: Tensor, y: Tensor, loss: str = "ce", y_target: Tensor | None = None, eot_iter: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    """One forward/backward: (detached float32 logits, per-sample loss, gradient of the summed loss w.r.t. x_adv).

    The loss is summed over the batch so each point's gradient does not depend on the batch size. Only
    the input's gradient is requested, so no parameter ``.grad`` is created or accumulated.

    With ``eot_iter`` > 1, the gradient is the mean over that many forward/backward passes: Expectation over
    Transformation (Athalye et al., ICML 2018) for a model that draws randomness in its forward pass, as the
    reference APGD's ``eot_iter`` does. The logits and losses are then the last pass's, as there.
    """
    grad = None
    for _ in range(eot_iter):
        with torch.enable_grad():  # the caller may be in no_grad (validation, evaluation)
            x_req = x_adv.detach().requires_grad_(True)
            logits = model(x_req)
            loss_indiv = per_sample_loss(logits, y, loss, y_target)
            (draw,) = torch.autograd.grad(loss_indiv.sum(), x_req)
        grad = draw if grad is None else grad + draw
    assert grad is not None  # eot_iter >= 1: one pass at least
    if eot_iter > 1:
        grad = grad / eot_iter
    return logits.detach().float(), loss_indiv.detach(), grad.detach()


# ------------------------------------------------------------------------------------------------ APGD


def _oscillation(loss_steps: Tensor, i: int, k: int, rho: float) -> Tensor:
    """True where the loss increased in at most ``rho * k`` of the last ``k`` steps (condition 1 of APGD).

    Compares rows i-k+1..i of ``loss_steps`` with their predecessors. Like the reference, the predecessor
    of row 0 is row -1, i.e. the (still zero) last row, which matters for ``k == 1`` at ``i == 0``; rolling
    by one row gives exactly that wrap-around with plain slicing (no index tensors).
    """
    current = loss_steps[i - k + 1 : i + 1]
    previous = loss_steps.roll(1, dims=0)[i - k + 1 : i + 1]
    return (current > previous).float().sum(0) <= k * rho


def _l1_sparse_direction(grad: Tensor, topk: Tensor, n_fts: int) -> Tensor:
    """L1 steepest-ascent direction restricted to the top ``topk`` fraction of coordinates by |grad|.

    Returns ``sign(g_sparse) / ||sign(g_sparse)||_1``, so that a step of size ``s`` moves ``s`` in L1.
    """
    flat = grad.abs().flatten(1)
    # Threshold = the value at rank (1 - topk) * n_fts of |grad| sorted ascending, i.e. the
    # (n_fts - rank)-th largest: a per-point k.
    rank = ((1.0 - topk) * n_fts).clamp(0, n_fts - 1).long()
    if host_reads_are_cheap(flat):  # only the largest values need sorting
        largest = flat.topk(int((n_fts - rank).max()), dim=1).values
    else:
        largest = flat.sort(1, descending=True).values
    threshold = largest.gather(1, (n_fts - 1 - rank)[:, None])
    sparse_sign = torch.sign(grad) * (grad.abs() >= _per_sample(threshold.squeeze(1), grad)).to(grad.dtype)
    return sparse_sign / (_per_sample(lp_norm(sparse_sign, "L1"), grad) + 1e-10)


def apgd(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str = "Linf",
    eps: float = 4 / 255,
    n_iter: int = 100,
    loss: str = "ce",
    y_target: Tensor | None = None,
    random_start: bool = False,
    x_init: Tensor | None = None,
    rho: float = 0.75,
    generator: torch.Generator | int | None = None,
    step_size: float | None = None,
    last_forward: Model | None = None,
    exit_broken: Tensor | None = None,
    eot_iter: int = 1,
    stop_point: StopPoint = lambda: None,
) -> APGDResult:
    """Run one APGD attack of ``n_iter`` steps on the batch ``x`` (values in [0, 1]) with labels ``y``.

    Args:
        model: any callable mapping a batch to logits (B, C); called as is (mode, autocast: the caller's).
        y: int64 labels (B,), or float probability targets (B, C) for ``loss="ce"``; with soft targets a
            point counts as correctly classified when the logits' argmax equals the targets' argmax.
        norm: "Linf", "L2" or "L1" (L1 takes sparse top-k steps with adaptive sparsity and the exact
            projection onto the L1 ball intersected with the box).
        loss: "ce", "dlr" or "dlr-targeted" (the latter needs ``y_target``, int64 (B,)).
        random_start: start from the reference's random point instead of ``x`` (drawn with ``generator``,
            a ``torch.Generator`` or an int seed; None uses the global RNG).
        x_init: explicit starting point, e.g. the result of a previous run at a larger eps (the AutoAttack
            L1 schedule). Clipped to [0, 1] but, as in the reference, not projected onto the eps-ball: do that
            first (``x + l1_projection(x, x_init - x, eps)``). For L1 it also sets the initial sparsity of
            the steps (its L0 distance to ``x`` / 1.5), so ``x_init=x`` means one coordinate per step at
            first. Exclusive with ``random_start``.
        rho: oscillation threshold of the step-size rule.
        step_size: initial step size; default 2 * eps (Linf, L2) or eps (L1). For L1 it is also the value
            the adaptive step is reset to and capped at.
        last_forward: computes the logits of the last iterate instead of ``model``, with gradients enabled;
            its output is returned as is in ``logits_last`` (adversarial training reuses this forward, graph
            included, for the update where the highest-loss iterate is the last one).
        exit_broken: for evaluation, where a misclassified iterate settles a point: the point each row belongs
            to (int64 (B,); ``torch.arange(B)`` for one run, a point's id on each of its rows when several
            target classes or restarts of it share the batch). After iterations 1, 2, 4, 8, ... the rows of
            every point that one of its rows has misclassified leave the run (one read back to the host each
            time, log2(n_iter) in all), so later forward passes skip them. The other rows go on unchanged. A
            row that left has its results as of then: ``robust`` and ``x_adv`` as final as the others',
            ``x_best``, ``loss_best``, ``logits_last`` and ``best_is_last`` of its last iterate; a row that left
            because another row broke its point may still be ``robust``.
        eot_iter: forward/backward passes whose input gradients are averaged at each iterate (Expectation over
            Transformation, for randomized models: AutoAttack's "rand" version takes 20); see
            :func:`input_gradient`.
        stop_point: called every ``STOP_CHECK_GRADIENT_PASSES`` gradient passes: every 10 iterations, or every
            iteration where ``eot_iter`` is 10 or more; it raises to stop the attack (an evaluation's job signal:
            one run on a large model can outlast a scheduler's grace period).

    The last iterate only needs its loss (no further step follows), so it gets a forward without the input
    gradient: n_iter + 1 forwards and n_iter input-gradient backwards in all.

    Returns:
        :class:`APGDResult`; all tensors float32 (bool for ``robust``) on ``x``'s device.
    """
    _validate(x, y, norm, eps, n_iter, loss, y_target)
    check_count("eot_iter", eot_iter, 1)
    if random_start and x_init is not None:
        raise ValueError("pass either random_start=True or x_init, not both")
    if x_init is not None and x_init.shape != x.shape:
        raise ValueError(f"x_init must have the shape of x {tuple(x.shape)}, got {tuple(x_init.shape)}")
    if exit_broken is not None and (exit_broken.shape != x.shape[:1] or exit_broken.dtype != torch.int64):
        raise ValueError(
            f"exit_broken must hold int64 point ids of shape ({x.shape[0]},), got {exit_broken.dtype} "
            f"of shape {tuple(exit_broken.shape)}"
        )
    if exit_broken is not None and last_forward is not None:
        raise ValueError("exit_broken is for evaluation; last_forward (training) needs every row's last iterate")

    x = x.detach().float()
    gen = _generator(generator, x.device)
    batch, n_fts = x.shape[0], x[0].numel()

    # Checkpoint schedule of the reference (in iterations).
    n_iter_2, n_iter_min = max(int(0.22 * n_iter), 1), max(int(0.06 * n_iter), 1)
    size_decr = max(int(0.03 * n_iter), 1)
    k = max(int(0.04 * n_iter), 1) if norm == "L1" else n_iter_2

    if x_init is not None:
        x_adv = x_init.detach().float().clone()
    elif random_start:
        x_adv = random_start_point(x, norm, eps, gen)
    else:
        x_adv = x.clone()
    x_adv = x_adv.clamp(0.0, 1.0)

    logits, loss_cur, grad = input_gradient(model, x_adv, y, loss, y_target, eot_iter)
    logits_start = logits
    zero_gradient = grad.flatten(1).abs().amax(1) == 0
    robust = predicted_correct(logits, y)
    x_best, x_best_adv, grad_best, loss_best = x_adv.clone(), x_adv.clone(), grad.clone(), loss_cur.clone()

    step_max = (2.0 if norm in ("Linf", "L2") else 1.0) * eps if step_size is None else float(step_size)
    step = torch.full(_per_sample(loss_best, x).shape, step_max, device=x.device)
    topk = sparsity_old = None
    if norm == "L1":
        # Fraction of coordinates moved per step; starts dense, then follows the sparsity of the best point.
        if x_init is None:
            topk = torch.full((batch,), 0.2, device=x.device)
            sparsity_old = torch.full((batch,), float(n_fts), device=x.device)
        else:
            sparsity_old = lp_norm(x_adv - x, "L0").float()
            topk = sparsity_old / n_fts / 1.5

    # the per-point state of the rows still attacked (rows leave it early with exit_broken)
    s = _Rows(
        rows=torch.arange(batch, device=x.device),  # the caller's row of each row still attacked
        exit_broken=exit_broken,
        x=x,
        y=y,
        y_target=y_target,
        x_adv=x_adv,
        x_adv_old=x_adv.clone(),
        grad=grad,
        x_best=x_best,
        x_best_adv=x_best_adv,
        grad_best=grad_best,
        loss_best=loss_best,
        loss_steps=torch.zeros(n_iter, batch, device=x.device),  # zeros on purpose: see _oscillation
        step=step,
        robust=robust,
        loss_best_last_check=loss_best,
        reduced_last_check=torch.ones(batch, dtype=torch.bool, device=x.device),
        logits=logits,
        improved=torch.zeros(batch, dtype=torch.bool, device=x.device),
        topk=topk,
        sparsity_old=sparsity_old,
    )
    since_check = 0
    stop_check_every = max(1, STOP_CHECK_GRADIENT_PASSES // eot_iter)  # iterations
    exited = []  # (rows, x_best, loss_best, x_best_adv, logits, improved, robust) of the rows that left
    for i in range(n_iter):
        if i and i % stop_check_every == 0:
            stop_point()
        # --- step: projected (sparse) ascent step, then momentum for Linf/L2 (none at the first step)
        momentum = s.x_adv - s.x_adv_old
        s.x_adv_old = s.x_adv
        a = 0.75 if i > 0 else 1.0
        if norm == "Linf":
            z = project(s.x, s.x_adv + s.step * torch.sign(s.grad), norm, eps)
            s.x_adv = project(s.x, s.x_adv + a * (z - s.x_adv) + (1 - a) * momentum, norm, eps)
        elif norm == "L2":
            z = project(s.x, s.x_adv + s.step * normalize(s.grad, "L2"), norm, eps)
            s.x_adv = project(s.x, s.x_adv + a * (z - s.x_adv) + (1 - a) * momentum, norm, eps)
        else:
            assert s.topk is not None  # set for L1
            s.x_adv = project(s.x, s.x_adv + s.step * _l1_sparse_direction(s.grad, s.topk, n_fts), norm, eps)

        # --- evaluate the new iterate
        if i < n_iter - 1:
            s.logits, loss_cur, s.grad = input_gradient(model, s.x_adv, s.y, loss, s.y_target, eot_iter)
        else:  # no step follows the last iterate: its loss is all that is needed
            s.logits, loss_cur = _last_logits(
                model if last_forward is None else last_forward,
                s.x_adv,
                s.y,
                loss,
                s.y_target,
                keep_graph=last_forward is not None,
            )
        correct = predicted_correct(s.logits, s.y)
        s.robust = s.robust & correct
        s.x_best_adv = torch.where(_per_sample(~correct, s.x), s.x_adv, s.x_best_adv)

        s.loss_steps[i] = loss_cur
        s.improved = loss_cur > s.loss_best  # strict: ties keep the earlier point
        s.x_best = torch.where(_per_sample(s.improved, s.x), s.x_adv, s.x_best)
        s.grad_best = torch.where(_per_sample(s.improved, s.x), s.grad, s.grad_best)
        s.loss_best = torch.where(s.improved, loss_cur, s.loss_best)

        # --- checkpoint: adapt the step size per point; points whose step shrinks restart from their best
        since_check += 1
        if since_check == k:
            if norm in ("Linf", "L2"):
                no_progress = ~s.reduced_last_check & (s.loss_best_last_check >= s.loss_best)
                restart = _oscillation(s.loss_steps, i, k, rho) | no_progress
                s.reduced_last_check = restart
                s.loss_best_last_check = s.loss_best
                s.step = torch.where(_per_sample(restart, s.x), s.step / 2.0, s.step)
                k = max(k - size_decr, n_iter_min)
            else:
                # L1: if the best point got sparser, reset the step to its maximum, else shrink it.
                sparsity = lp_norm(s.x_best - s.x, "L0").float()
                assert s.sparsity_old is not None  # set for L1
                restart = sparsity / s.sparsity_old < 0.95
                s.topk = sparsity / n_fts / 1.5
                s.step = torch.where(_per_sample(restart, s.x), step_max, s.step / 1.5).clamp(step_max / 10.0, step_max)
                s.sparsity_old = sparsity
            s.x_adv = torch.where(_per_sample(restart, s.x), s.x_best, s.x_adv)
            s.grad = torch.where(_per_sample(restart, s.x), s.grad_best, s.grad)
            since_check = 0

        # --- early exit: the rows of broken points leave (at iterations 1, 2, 4, ...: one read back each time)
        if s.exit_broken is not None and i < n_iter - 1 and (i + 1) & i == 0:
            leave = ((s.exit_broken[:, None] == s.exit_broken[None, :]) & ~s.robust).any(1)  # a row of its point broke
            n_leave = int(leave.sum())
            if n_leave:
                by_leave = leave.to(torch.uint8).argsort(stable=True)  # the rows that stay, then those that leave
                stay, gone = by_leave[: len(leave) - n_leave], by_leave[len(leave) - n_leave :]
                exited.append(s.results(gone))
                s.keep(stay)
                if not len(s.rows):
                    break

    if exited:  # put the rows that left and those that stayed back in the caller's order
        parts = [*exited, s.results()]
        order = torch.cat([part[0] for part in parts]).argsort()
        x_best, loss_best, x_best_adv, logits, improved, robust = (
            torch.cat([part[j] for part in parts])[order] for j in range(1, 7)
        )
    else:
        _, x_best, loss_best, x_best_adv, logits, improved, robust = s.results()
    return APGDResult(
        x_best=x_best,
        loss_best=loss_best,
        x_adv=x_best_adv,
        robust=robust,
        logits_last=logits,
        logits_start=logits_start,
        best_is_last=improved,
        zero_gradient=zero_gradient,
    )


@dataclass
class _Rows:
    """The per-row state of an APGD run, of the rows still attacked. Where rows leave early (``exit_broken``), the
    run hands their results over (``results``) and keeps the other rows of every tensor (``keep``)."""

    rows: Tensor  # the caller's row of each row
    exit_broken: Tensor | None
    x: Tensor
    y: Tensor
    y_target: Tensor | None
    x_adv: Tensor
    x_adv_old: Tensor
    grad: Tensor
    x_best: Tensor
    x_best_adv: Tensor
    grad_best: Tensor
    loss_best: Tensor
    loss_steps: Tensor  # (n_iter, rows): a column per row
    step: Tensor
    robust: Tensor
    loss_best_last_check: Tensor
    reduced_last_check: Tensor
    logits: Tensor
    improved: Tensor
    topk: Tensor | None  # L1 only
    sparsity_old: Tensor | None  # L1 only

    def results(self, index: Tensor | None = None) -> tuple[Tensor, ...]:
        """(rows, x_best, loss_best, x_best_adv, logits, improved, robust) of the rows ``index`` (default: all)."""
        kept = (self.rows, self.x_best, self.loss_best, self.x_best_adv, self.logits, self.improved, self.robust)
        return kept if index is None else tuple(t[index] for t in kept)

    def keep(self, index: Tensor) -> None:
        """Keep the rows ``index`` alone."""
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                setattr(self, field.name, value[:, index] if field.name == "loss_steps" else value[index])


def _last_logits(
    forward: Model, x_adv: Tensor, y: Tensor, loss: str, y_target: Tensor | None, keep_graph: bool
) -> tuple[Tensor, Tensor]:
    """Logits and per-sample loss of the final iterate, which needs no input gradient."""
    if keep_graph:
        with torch.enable_grad():
            logits = forward(x_adv.detach())
        return logits, per_sample_loss(logits.detach(), y, loss, y_target)
    with torch.no_grad():
        logits = forward(x_adv).float()
    return logits, per_sample_loss(logits, y, loss, y_target)
