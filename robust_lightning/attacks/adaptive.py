"""The adaptive attacks that answer AutoAttack's raised checks, each a plain attack on every point it is given.

Standard AutoAttack assumes that the model's gradients lead somewhere. Where its checks say they may not
(:mod:`robust_lightning.attacks.checks`, ``ANSWERS``), these attacks take their place:

- **BPDA** (Athalye et al., 2018, "Obfuscated Gradients Give a False Sense of Security", Sec. 4.1): the parts of the
  model that mask the gradient (an input quantisation, a non-differentiable step) are approximated backward by the
  identity, or by a differentiable stand-in, while their forward stays the same (:func:`straight_through`);
  APGD-CE and APGD-T attack that copy.
- **Transfer** (Papernot et al., 2016; Tramer et al., 2020, "On Adaptive Attacks to Adversarial Example
  Defenses"): the same attacks on a surrogate, the model without those parts (:func:`without_parts`) or another
  model.
- **EoT** (Athalye et al., 2018, "Synthesizing Robust Adversarial Examples"): for a randomized model, APGD-CE and
  APGD-DLR with the gradient averaged over draws (as AutoAttack's "rand" version), and the adversarial example
  scored by the share of ``draws`` forward passes that still classify it correctly: the expected robust accuracy.
- **Square from scratch** (Andriushchenko et al., 2020): Square Attack, which needs no gradient, with restarts, on
  every point the model classifies correctly, not only on the survivors of the other attacks.

Whatever the attack ran on, a point counts as broken only where the real model, as given, misclassifies the
candidate; every candidate lies in the eps-ball around its point and in [0, 1].
"""

import copy
import difflib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .apgd import StopPoint, apgd, predicted_correct
from .square import square_attack

Model = Callable[[Tensor], Tensor]


@dataclass
class AdaptiveResult:
    name: str  # "bpda", "transfer", "eot" or "square"
    # per point, on the CPU, in [0, 1]: 1.0 still correct, 0.0 broken or misclassified without attack; for "eot"
    # the share of the draws that classify the point's adversarial example correctly
    robust: Tensor
    x_adv: Tensor  # per point, the adversarial example (the clean image where none was found), on the CPU
    seconds: float
    notes: str = ""


# --------------------------------------------------------------------------------------- model surgery
class _StraightThrough(nn.Module):
    """A part whose forward is its own and whose backward is the identity's, or ``stand_in``'s."""

    def __init__(self, part: nn.Module, stand_in: nn.Module | None, name: str) -> None:
        super().__init__()
        self.part, self.stand_in, self.name = part, stand_in, name

    def forward(self, x: Tensor) -> Tensor:
        out = self.part(x)
        if self.stand_in is None:
            if out.shape != x.shape:
                raise ValueError(
                    f"bpda part {self.name!r} changes the shape ({tuple(x.shape)} -> {tuple(out.shape)}): the "
                    "identity cannot stand in for its backward pass; give a differentiable stand-in (stand_ins)"
                )
            straight: Tensor = x + (out - x).detach()
            return straight
        approximation = self.stand_in(x)
        through: Tensor = approximation + (out - approximation).detach()
        return through


def _replaced(model: nn.Module, parts: Sequence[str], make: Callable[[str, nn.Module], nn.Module]) -> nn.Module:
    """A deep copy of ``model`` with each named part replaced by ``make(name, part)``."""
    copied = copy.deepcopy(model)
    modules = dict(copied.named_modules())
    for name in parts:
        if not name or name not in modules:
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
            raise ValueError(
                f"bpda part {name!r} is not a module of the model (a dotted name of model.named_modules())"
                + (f"; did you mean {', '.join(close)}?" if close else "")
            )
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else copied, child, make(name, modules[name]))
    return copied


def straight_through(
    model: nn.Module, parts: Sequence[str], stand_ins: Mapping[str, nn.Module] | None = None
) -> nn.Module:
    """A copy of ``model`` whose parts named in ``parts`` compute their own forward but pass the identity's
    gradient backward, or ``stand_ins[name]``'s where given (BPDA). The model itself is left as it was."""
    given = dict(stand_ins or {})
    return _replaced(model, parts, lambda name, part: _StraightThrough(part, given.get(name), name))


def without_parts(
    model: nn.Module, parts: Sequence[str], stand_ins: Mapping[str, nn.Module] | None = None
) -> nn.Module:
    """The surrogate of a transfer attack: a copy of ``model`` with each part replaced by its stand-in, or taken
    out (the identity)."""
    given = dict(stand_ins or {})
    return _replaced(model, parts, lambda name, part: given.get(name) or nn.Identity())


# --------------------------------------------------------------------------------------------- attacks
@torch.no_grad()
def _correct(model: Model, x: Tensor, y: Tensor) -> Tensor:
    return predicted_correct(model(x).float(), y)


def _batches(n: int, bs: int | None) -> list[slice]:
    step = bs or max(n, 1)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _batchwise(
    x: Tensor,
    y: Tensor,
    bs: int | None,
    attack: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    stop_point: StopPoint,
) -> tuple[Tensor, Tensor]:
    """``attack(xb, yb) -> (robust, x_adv)`` on each batch of ``bs`` points, the results gathered on the CPU;
    ``stop_point()`` before each batch."""
    robust, x_adv = [], []
    for part in _batches(len(x), bs):  # each batch's results leave the device before the next batch
        stop_point()
        still, best = attack(x[part], y[part])
        robust.append(still.float().cpu())
        x_adv.append(best.cpu())
    return torch.cat(robust), torch.cat(x_adv)


def _classes(model: Model, x: Tensor) -> int:
    with torch.no_grad():
        return int(model(x[:1]).shape[-1])


def transfer_attack(
    model: Model,
    surrogate: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str,
    eps: float,
    n_iter: int = 100,
    n_target_classes: int = 9,
    seed: int = 0,
    bs: int | None = None,
    name: str = "transfer",
    stop_point: StopPoint = lambda: None,
) -> AdaptiveResult:
    """APGD-CE, then APGD-T (targeted DLR at the ``n_target_classes`` highest other classes, as many as there are;
    none below 4 classes), on ``surrogate``, against every point that ``model`` classifies correctly. Both the
    highest-loss and the last misclassified iterate of each run are tried on ``model``, which alone decides.
    ``stop_point()`` is called before each batch and each run; it raises to stop (a job's stop signal)."""
    started = time.perf_counter()
    classes = _classes(model, x)
    targets = min(n_target_classes, classes - 1) if classes >= 4 else 0

    def attack(xb: Tensor, yb: Tensor) -> tuple[Tensor, Tensor]:
        still, best = _correct(model, xb, yb), xb.clone()
        with torch.no_grad():
            ranked = model(xb).float().sort(dim=1)[1]
        runs: list[dict[str, Any]] = [{"loss": "ce"}]
        runs += [{"loss": "dlr-targeted", "y_target": ranked[:, -rank]} for rank in range(2, targets + 2)]
        for run in runs:
            stop_point()
            todo = still.nonzero().flatten()
            if not len(todo):
                break
            y_target = run.get("y_target")
            result = apgd(
                surrogate,
                xb[todo],
                yb[todo],
                norm=norm,
                eps=eps,
                n_iter=n_iter,
                loss=run["loss"],
                y_target=None if y_target is None else y_target[todo],
                random_start=True,
                generator=seed,
                stop_point=stop_point,
            )
            for candidate in (result.x_adv, result.x_best):
                broken = still[todo] & ~_correct(model, candidate, yb[todo])
                best[todo[broken]] = candidate[broken].detach()
                still[todo[broken]] = False
        return still, best

    robust, x_adv = _batchwise(x, y, bs, attack, stop_point)
    return AdaptiveResult(name, robust, x_adv, time.perf_counter() - started)


def bpda_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    parts: Sequence[str],
    stand_ins: Mapping[str, nn.Module] | None = None,
    norm: str,
    eps: float,
    n_iter: int = 100,
    n_target_classes: int = 9,
    seed: int = 0,
    bs: int | None = None,
    stop_point: StopPoint = lambda: None,
) -> AdaptiveResult:
    """BPDA: :func:`transfer_attack` from the straight-through copy of ``model`` (:func:`straight_through`), whose
    forward is the model's own."""
    approximated = straight_through(model, parts, stand_ins)
    return transfer_attack(
        model,
        approximated,
        x,
        y,
        norm=norm,
        eps=eps,
        n_iter=n_iter,
        n_target_classes=n_target_classes,
        seed=seed,
        bs=bs,
        name="bpda",
        stop_point=stop_point,
    )


@torch.no_grad()
def _share_correct(model: Model, x: Tensor, y: Tensor, draws: int) -> Tensor:
    """Per point, the share of ``draws`` forward passes that classify it correctly."""
    return sum((_correct(model, x, y).float() for _ in range(draws)), torch.zeros(len(x), device=x.device)) / draws


def eot_attack(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str,
    eps: float,
    draws: int = 20,
    eot_iter: int = 20,
    n_iter: int = 100,
    seed: int = 0,
    bs: int | None = None,
    stop_point: StopPoint = lambda: None,
) -> AdaptiveResult:
    """EoT against a randomized model: APGD-CE and APGD-DLR (with 3 classes or more) with the gradient averaged
    over ``eot_iter`` passes per iterate; each point's figure is the share of ``draws`` passes that classify its
    worst candidate correctly (the clean image, and each run's highest-loss iterate), the expected robust
    accuracy over the model's draws. ``stop_point()`` is called before each batch and each run."""
    started = time.perf_counter()
    losses = ("ce", "dlr") if _classes(model, x) >= 3 else ("ce",)

    def attack(xb: Tensor, yb: Tensor) -> tuple[Tensor, Tensor]:
        share, best = _share_correct(model, xb, yb, draws), xb.clone()
        for loss in losses:
            stop_point()
            result = apgd(
                model, xb, yb, norm=norm, eps=eps, n_iter=n_iter, loss=loss, eot_iter=eot_iter, generator=seed,
                stop_point=stop_point,
            )  # fmt: skip
            candidate = result.x_best.detach()
            candidate_share = _share_correct(model, candidate, yb, draws)
            lower = candidate_share < share
            best[lower], share = candidate[lower], torch.minimum(share, candidate_share)
        return share, best

    robust, x_adv = _batchwise(x, y, bs, attack, stop_point)
    return AdaptiveResult("eot", robust, x_adv, time.perf_counter() - started)


def square_from_scratch(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str,
    eps: float,
    n_queries: int = 5000,
    n_restarts: int = 5,
    seed: int = 0,
    bs: int | None = None,
    stop_point: StopPoint = lambda: None,
) -> AdaptiveResult:
    """Square Attack with ``n_restarts`` restarts (seeds ``seed``, ``seed + 1``, ...) on every point the model
    classifies correctly: each restart attacks the points the earlier ones left standing. ``stop_point()`` is
    called before each batch and each restart, and every 50 passes of Square."""
    started = time.perf_counter()

    def attack(xb: Tensor, yb: Tensor) -> tuple[Tensor, Tensor]:
        still, best = _correct(model, xb, yb), xb.clone()
        for restart in range(n_restarts):
            stop_point()
            todo = still.nonzero().flatten()
            if not len(todo):
                break
            generator = torch.Generator(device=xb.device).manual_seed(seed + restart)
            result = square_attack(
                model,
                xb[todo],
                yb[todo],
                norm=norm,
                eps=eps,
                n_queries=n_queries,
                generator=generator,
                stop_point=stop_point,
            )
            broken = ~result.robust & ~_correct(model, result.x_adv, yb[todo])
            best[todo[broken]] = result.x_adv[broken]
            still[todo[broken]] = False
        return still, best

    robust, x_adv = _batchwise(x, y, bs, attack, stop_point)
    return AdaptiveResult("square", robust, x_adv, time.perf_counter() - started)
