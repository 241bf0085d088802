"""FGSM, FGSM with random start (Wong, Rice & Kolter, 2020) and PGD (Madry et al., 2018).

Same conventions as :func:`robust_lightning.attacks.apgd.apgd`: inputs in [0, 1], ``y`` int64 labels or
float soft targets (B, C) for the cross-entropy, input-only gradients (parameters' ``.grad`` untouched, the
model's mode left alone), float32 perturbations under autocast, no host-device synchronisation. Each
function returns the adversarial batch (float32, detached).
"""

import torch
from torch import Tensor

from .apgd import Model, _generator, _sample, _validate, input_gradient
from .projections import normalize, project, project_linf


def _uniform_linf(x: Tensor, eps: float, generator: torch.Generator | None) -> Tensor:
    """Start uniformly distributed in the Linf ball, clipped to the box (Wong et al.; Madry et al.)."""
    return (x + eps * (2 * _sample("rand", x, generator) - 1)).clamp(0.0, 1.0)


def fgsm(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    eps: float,
    random_start: bool = False,
    alpha: float | None = None,
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """One signed-gradient step on the cross-entropy, projected onto the Linf ball of radius ``eps`` and [0, 1].

    FGSM (``random_start=False``): ``clip(x + alpha * sign(grad), 0, 1)`` with ``alpha = eps`` by default.
    FGSM-RS (``random_start=True``): start uniformly in the ball, step ``alpha = 1.25 * eps`` by default.
    """
    _validate(x, y, "Linf", eps, 1, "ce", None)
    x = x.detach().float()
    if alpha is None:
        alpha = 1.25 * eps if random_start else eps
    x_adv = _uniform_linf(x, eps, _generator(generator, x.device)) if random_start else x.clone()
    _, _, grad = input_gradient(model, x_adv, y, "ce")
    return project_linf(x, x_adv + alpha * torch.sign(grad), eps)


def pgd(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str = "Linf",
    eps: float,
    n_iter: int = 10,
    step_size: float | None = None,
    random_start: bool = True,
    loss: str = "ce",
    generator: torch.Generator | int | None = None,
) -> Tensor:
    """Projected gradient ascent with a fixed step, returning the last iterate (Madry et al.).

    Linf takes signed-gradient steps, L2 steps along the L2-normalised gradient. The default step is
    ``2.5 * eps / n_iter``, the rule of thumb of Madry et al.'s ``robustness`` library (the steps add up to
    more than the ball's diameter, so the boundary can be reached from any start). The random
    start is uniform in the Linf ball, or for L2 on the sphere of radius ``eps`` (Gaussian direction);
    both are clipped to [0, 1]. ``loss`` is "ce" (hard or soft targets) or "dlr" (hard labels).
    """
    if norm not in ("Linf", "L2"):
        raise ValueError(f"pgd supports norms 'Linf' and 'L2', got {norm!r} (use apgd for L1)")
    if loss not in ("ce", "dlr"):
        raise ValueError(f"pgd supports losses 'ce' and 'dlr', got {loss!r}")
    _validate(x, y, norm, eps, n_iter, loss, None)
    if step_size is not None and not step_size > 0:
        raise ValueError(f"step_size must be > 0, got {step_size}")
    x = x.detach().float()
    step = 2.5 * eps / n_iter if step_size is None else step_size
    gen = _generator(generator, x.device)

    if not random_start:
        x_adv = x.clone()
    elif norm == "Linf":
        x_adv = _uniform_linf(x, eps, gen)
    else:
        x_adv = (x + eps * normalize(_sample("randn", x, gen), "L2")).clamp(0.0, 1.0)

    for _ in range(n_iter):
        _, _, grad = input_gradient(model, x_adv, y, loss)
        direction = torch.sign(grad) if norm == "Linf" else normalize(grad, "L2")
        x_adv = project(x, x_adv + step * direction, norm, eps)
    return x_adv
