"""The sanity checks of Carlini et al. (2019, "On Evaluating Adversarial Robustness", Sec. 5) that can be automated,
beside the reference AutoAttack's own (:mod:`robust_lightning.attacks.checks`), each a :class:`Check` of the same
form. They run 10-step APGD-CE on a few hundred points, so they cost little next to AutoAttack:

- ``eps_monotonic``: the robust accuracy falls (or stays) as the radius grows, over 0.5, 1, 2 and 4 times eps;
- ``unbounded``: an attack whose ball reaches mid-grey from any image (Linf 0.5; L2 and L1 radii scaled to the same
  reach) leaves no point robust; its figures include the share of points whose fp32 cross-entropy gradient is
  exactly zero (a saturated softmax);
- ``iterative_vs_one_step``: the iterative attack is at least as strong as one gradient step (FGSM in Linf, the
  fast gradient method in L2 and L1);
- ``engines_agree``: the fast engine and the reference engine (pyautoattack) call the same points robust, at least
  90 % of them (counted exactly).

The iterative attacks run APGD with the cross-entropy and with the DLR loss, and a point counts as robust only
where both fail: the DLR loss is invariant to the logits' scale, so a model whose large logits saturate the
softmax (and zero its cross-entropy gradient) is not mistaken for a masked one (Croce & Hein, 2020). Where a check
is raised, the attack's gradients probably mislead it (gradient masking), and the robust accuracy of any
gradient-based evaluation, AutoAttack's included, may not hold; the evaluation then runs the adaptive attacks
(robust_lightning.attacks.checks.ANSWERS). A randomized model (two passes over the same points disagree) is told
so in the advice: the engines then disagree by its draws, and EoT answers it.
"""

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .apgd import Model, StopPoint, apgd, input_gradient, predicted_correct
from .checks import Check
from .projections import normalize, project
from .simple import fgsm

EPS_MULTIPLIERS = (0.5, 1.0, 2.0, 4.0)
AGREEMENT_MIN = (9, 10)  # engines_agree is raised below 9 points in 10 with the same verdict (compared in integers)


def unbounded_eps(norm: str, x: Tensor) -> float:
    """A radius whose ball around any image in [0, 1] holds mid-grey: 0.5 per coordinate, in the norm's measure."""
    dims = x[0].numel()
    root: float = dims**0.5
    return {"Linf": 0.5, "L2": 0.5 * root, "L1": 0.5 * dims}[norm]


@torch.no_grad()
def _correct(model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> Tensor:
    return predicted_correct(model(x), y)


def _apgd_robust(
    model: Model, x: Tensor, y: Tensor, norm: str, eps: float, n_iter: int, seed: int, stop_point: StopPoint
) -> Tensor:
    """Per point: correctly classified on the clean image and on every iterate of APGD-CE and of APGD-DLR (random
    start; DLR with three classes or more). ``stop_point()`` is called before each run and inside it."""
    robust = _correct(model, x, y)
    for loss in ("ce", "dlr") if _classes(model, x) >= 3 else ("ce",):
        stop_point()
        run = apgd(
            model,
            x,
            y,
            norm=norm,
            eps=eps,
            n_iter=n_iter,
            loss=loss,
            random_start=True,
            generator=seed,
            stop_point=stop_point,
        )
        robust &= run.robust
    return robust


@torch.no_grad()
def _classes(model: Callable[[Tensor], Tensor], x: Tensor) -> int:
    return int(model(x[:1]).shape[-1])


def saturated_share(model: Model, x: Tensor, y: Tensor) -> float:
    """The share of points whose fp32 cross-entropy input gradient is exactly zero (their softmax saturated)."""
    _, _, grad = input_gradient(model, x.float(), y, "ce")
    return _share(grad.flatten(1).abs().amax(1) == 0)


@torch.no_grad()
def randomized_outputs(model: Callable[[Tensor], Tensor], x: Tensor) -> bool:
    """Whether two passes of the model over the same points give different outputs (a randomized model)."""
    return not torch.equal(model(x), model(x))


def _one_step_robust(model: Model, x: Tensor, y: Tensor, norm: str, eps: float) -> Tensor:
    """Per point: correctly classified on the clean image and after one gradient step of the cross-entropy."""
    if norm == "Linf":
        stepped = fgsm(model, x, y, eps=eps)
    else:
        _, _, grad = input_gradient(model, x, y, "ce")
        stepped = project(x, x + eps * normalize(grad, norm), norm, eps)
    return _correct(model, x, y) & _correct(model, stepped, y)


def _share(flags: Tensor) -> float:
    return flags.float().mean().item()


def eps_monotonic(accuracies: dict[float, float]) -> Check:
    """``accuracies``: APGD-CE's robust accuracy at each multiple of eps, in increasing order."""
    values = list(accuracies.values())
    raised = any(later > earlier for earlier, later in itertools.pairwise(values))
    return Check(
        "eps_monotonic",
        raised,
        {f"robust_accuracy_at_{m:g}x_eps": value for m, value in accuracies.items()},
        "the robust accuracy rises with the radius somewhere: the attack's gradients mislead it (gradient masking); "
        "do not trust the robust accuracy before an adaptive attack confirms it"
        if raised
        else "",
    )


def unbounded(
    model: Model, x: Tensor, y: Tensor, norm: str, n_iter: int, seed: int, stop_point: StopPoint = lambda: None
) -> Check:
    radius = unbounded_eps(norm, x)
    left = _share(_apgd_robust(model, x, y, norm, radius, n_iter, seed, stop_point))
    return Check(
        "unbounded",
        left > 0,
        {"eps": radius, "robust_accuracy": left, "ce_gradient_zero_share": saturated_share(model, x, y)},
        f"{left:.1%} of the points stay robust to an attack whose ball reaches mid-grey from any image: the attack "
        "fails for another reason than the threat model (masked or obfuscated gradients)"
        if left > 0
        else "",
    )


def iterative_vs_one_step(model: Model, x: Tensor, y: Tensor, norm: str, eps: float, iterative: float) -> Check:
    """``iterative``: APGD-CE's robust accuracy at eps (the one eps_monotonic measured)."""
    one_step = _share(_one_step_robust(model, x, y, norm, eps))
    raised = iterative > one_step
    return Check(
        "iterative_vs_one_step",
        raised,
        {"robust_accuracy_iterative": iterative, "robust_accuracy_one_step": one_step},
        "one gradient step breaks more points than the iterative attack: its gradients mislead it further from the "
        "point (gradient masking)"
        if raised
        else "",
    )


def too_few_agree(same: int, points: int) -> bool:
    """Whether fewer than 9 in 10 of ``points`` got the same verdict, compared in integers: 36 of 40 as a float32
    share is 0.8999999762, below 0.9."""
    return same * AGREEMENT_MIN[1] < AGREEMENT_MIN[0] * points


def engines_agree(
    model: Model, x: Tensor, y: Tensor, norm: str, eps: float, n_iter: int, seed: int, randomized: bool = False
) -> Check:
    from .ensemble import AutoAttack  # noqa: PLC0415 (ensemble imports the checks)

    settings: dict[str, Any] = {
        "norm": norm,
        "eps": eps,
        "seed": seed,
        "verbose": False,
        "version": "apgd-ce",
        "n_iter": n_iter,
    }
    verdicts = {
        engine: AutoAttack(model, engine=engine, checks=False, **settings).evaluate(x, y, bs=len(x))
        for engine in ("fast", "reference")
    }
    same = int((verdicts["fast"].robust == verdicts["reference"].robust).sum())
    raised = too_few_agree(same, len(x))
    if not raised:
        advice = ""
    elif randomized:
        advice = (
            f"the fast and the reference engine disagree on {len(x) - same} of {len(x)} points, and the model's "
            "outputs change between passes over the same points (a randomized model): the engines' verdicts differ "
            "by its draws; EoT (the adaptive attack eot, or version='rand') evaluates it"
        )
    else:
        advice = (
            f"the fast and the reference engine disagree on {len(x) - same} of {len(x)} points: run the evaluation "
            "with engine='reference'"
        )
    return Check(
        "engines_agree",
        raised,
        {
            "points": len(x),
            "agreeing": same,
            "agreement": same / len(x),
            "robust_accuracy_fast": verdicts["fast"].robust_accuracy,
            "robust_accuracy_reference": verdicts["reference"].robust_accuracy,
        },
        advice,
    )


def sanity_checks(
    model: Model,
    x: Tensor,
    y: Tensor,
    norm: str,
    eps: float,
    n_iter: int = 10,
    seed: int = 0,
    stop_point: StopPoint = lambda: None,
) -> list[Check]:
    """Every check above on the points ``x`` (in [0, 1]) with labels ``y``, with ``n_iter``-step APGD-CE and
    APGD-DLR. ``stop_point()`` is called before each APGD run (and inside a long one) and before the engines'
    comparison; it raises to stop the checks (a job's stop signal), which then run again from their start."""
    accuracies = {
        m: _share(_apgd_robust(model, x, y, norm, m * eps, n_iter, seed, stop_point)) for m in EPS_MULTIPLIERS
    }
    checks = [
        eps_monotonic(accuracies),
        unbounded(model, x, y, norm, n_iter, seed, stop_point),
        iterative_vs_one_step(model, x, y, norm, eps, accuracies[1.0]),
    ]
    stop_point()
    return [*checks, engines_agree(model, x, y, norm, eps, n_iter, seed, randomized_outputs(model, x))]
