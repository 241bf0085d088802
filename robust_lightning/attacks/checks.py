"""The checks of the reference AutoAttack (fra31/auto-attack, ``autoattack/checks.py``, explained in its
``flags_doc.md``): signs that a model is of a kind the standard version cannot evaluate, so that its robust accuracy
would not be trusted. Each check is computed as the reference computes it and returns a :class:`Check`: its name
(the reference function's, without ``check_``), whether it was raised, its figures and one sentence of advice.

Where this code departs from the reference, on purpose:

- ``dynamic`` counts the gradient calls of its own forward pass. The reference counts into a module-level table
  that no call resets, so once one model in a process raised it, every later model does too.
- ``n_classes`` names FAB-T's own target count in its figures (the reference's message prints APGD-T's).
"""

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor

# the reference's checks, by name (its check_* functions without the prefix)
REFERENCE_CHECKS = ("randomized", "range_output", "zero_gradients", "square_sr", "dynamic", "n_classes")
# the functions whose calls inside a forward pass mark it as computing gradients (the reference's list)
GRADIENT_FUNCTIONS = ("grad", "backward", "_make_grads")
# where the advice sends the user: this project's account of the checks and the attacks that answer them (the
# reference's messages point to its flags_doc.md, which is not shipped here)
DOCS = "docs/evaluation.md"


@dataclass
class Check:
    name: str  # the reference's function name without "check_": randomized, range_output, zero_gradients, ...
    raised: bool
    figures: dict[str, Any] = field(default_factory=dict)
    advice: str = ""  # what to run instead, where raised

    def record(self) -> dict[str, Any]:
        """What results.json keeps of it, under its name: raised, figures, advice."""
        return {key: value for key, value in asdict(self).items() if key != "name"}


def _unit_rows(logits: Tensor) -> Tensor:
    norms: Tensor = logits.norm(dim=1, keepdim=True)
    return logits / (norms + 1e-10)


@torch.no_grad()
def randomized(model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, n: int = 5, alpha: float = 1e-4) -> Check:
    """Raised where ``n`` forward passes of the same batch disagree: another count of correct points than the last
    pass's, or normalised logits further apart than ``alpha`` (L2, the largest over the points and pairs)."""
    outputs = [model(x).float() for _ in range(n)]
    correct = [int((output.argmax(1) == y).sum()) for output in outputs]
    units = [_unit_rows(output) for output in outputs]
    spread = max(
        ((units[a] - units[b]).norm(dim=1).max().item() for a in range(n) for b in range(a + 1, n)), default=0.0
    )
    raised = any(c != correct[-1] for c in correct) or spread > alpha
    return Check(
        "randomized",
        raised,
        {"passes": n, "correct_per_pass": correct, "max_logit_distance": spread, "threshold": alpha},
        'the outputs change between calls on the same input (a randomized defence): evaluate with version="rand", '
        "which averages the gradients over 20 draws, and report EoT's expected robust accuracy, which adaptive: auto "
        f"runs ({DOCS}, Adaptive attacks)"
        if raised
        else "",
    )


@torch.no_grad()
def range_output(model: Callable[[Tensor], Tensor], x: Tensor, alpha: float = 1e-5) -> Check:
    """Raised where the outputs look like probabilities: all in (-alpha, 1 + alpha), each row summing to 1 within
    ``alpha``. Its figures also give the number of classes (the outputs' last dimension)."""
    output = model(x).float()
    raised = bool(output.max() < 1 + alpha and output.min() > -alpha and ((output.sum(-1) - 1).abs() < alpha).all())
    return Check(
        "range_output",
        raised,
        {"num_classes": output.shape[-1], "min": output.min().item(), "max": output.max().item()},
        "the outputs look like probabilities (in [0, 1], each row summing to 1): give AutoAttack the logits, "
        "before the softmax, whose losses the attacks are built for"
        if raised
        else "",
    )


def zero_gradients(grad: Tensor) -> Check:
    """Raised where a point's input gradient is zero everywhere (the reference computes it at APGD's start, for
    the DLR losses): a gradient-based attack cannot move that point."""
    return zero_gradient_starts(int((grad.reshape(len(grad), -1).abs().sum(-1) == 0).sum()), len(grad))


def zero_gradient_starts(zero: int, starts: int) -> Check:
    """zero_gradients counted over APGD starts: ``zero`` of the ``starts`` (a point's start in one run, restart or
    target) had an input gradient that is zero everywhere. The reference checks it at every APGD start of its DLR
    attacks, on the points still attacked."""
    return Check(
        "zero_gradients",
        zero > 0,
        {"starts_with_zero_gradient": zero, "starts": starts},
        f"{zero} APGD starts had a zero input gradient (input quantization, a saturated output, a non-differentiable "
        "step): gradient-based attacks make no progress there; the adaptive attacks (BPDA with the masking parts "
        f"named in bpda, a transfer attack, Square from scratch) answer it ({DOCS}, Adaptive attacks)"
        if zero
        else "",
    )


def square_sr(robust_after: dict[str, float], alpha: float = 0.002) -> Check:
    """``robust_after``: the accuracy after each attack, in order, with "clean" first, as the reference's
    ``robust_accuracy_dict``. Raised where Square, which uses no gradient, lowered the robust accuracy more than
    ``alpha`` below that of the other attacks: their gradients may be masked."""
    ran = "square" in robust_after and len(robust_after) > 2
    others = min((v for k, v in robust_after.items() if k != "square"), default=None)
    drop = others - robust_after["square"] if ran and others is not None else 0.0  # ran: others exist
    raised = ran and drop > alpha
    return Check(
        "square_sr",
        raised,
        {"square_lowered_robust_accuracy_by": drop, "threshold": alpha} if ran else {"square_ran": False},
        f"Square Attack, which uses no gradient, lowered the robust accuracy by {drop:.2%} after the gradient-based "
        "attacks: their gradients may be masked; Square with restarts from scratch, BPDA and a transfer attack, which "
        f"adaptive: auto runs, answer it ({DOCS}, Adaptive attacks)"
        if raised
        else "",
    )


def dynamic(model: Callable[[Tensor], Tensor], x: Tensor) -> Check:
    """Raised where the forward pass computes gradients itself (it calls ``grad``, ``backward`` or
    ``_make_grads``): a defence that optimises at inference, which the attacks' gradients do not see through."""
    calls = dict.fromkeys(GRADIENT_FUNCTIONS, 0)

    def count(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name in calls:
            calls[frame.f_code.co_name] += 1

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        model(x)
    finally:
        sys.settrace(previous)
    raised = any(calls.values())
    return Check(
        "dynamic",
        raised,
        dict(calls),  # calls of each gradient function during the forward pass
        "the forward pass computes gradients (a dynamic defence): standard AutoAttack may not be enough; the "
        f"adaptive attacks answer it, BPDA with the parts that optimise named in bpda ({DOCS}, Adaptive attacks)"
        if raised
        else "",
    )


def n_classes(num_classes: int, attacks: tuple[str, ...], apgd_targets: int, fab_targets: int) -> Check:
    """Raised where the class count is too small for the attacks: the DLR loss needs 3 classes and its targeted
    form 4, and each targeted attack needs as many other classes as its targets."""
    problems = []
    if "apgd-dlr" in attacks or "apgd-t" in attacks:
        if num_classes <= 2:
            problems.append(f"with {num_classes} classes the DLR loss cannot be used")
        elif num_classes == 3:
            problems.append(f"with {num_classes} classes the targeted DLR loss cannot be used")
        elif "apgd-t" in attacks and apgd_targets + 1 > num_classes:
            problems.append(f"APGD-T uses {apgd_targets} target classes, {num_classes - 1} are possible")
    if "fab-t" in attacks and fab_targets + 1 > num_classes:
        problems.append(f"FAB-T uses {fab_targets} target classes, {num_classes - 1} are possible")
    return Check(
        "n_classes",
        bool(problems),
        {"num_classes": num_classes, "apgd_targets": apgd_targets, "fab_targets": fab_targets},
        "; ".join(problems) + ": the attacks the class count does not allow are left out, and the targeted ones aim "
        "at the classes there are"
        if problems
        else "",
    )


# ------------------------------------------------------------------------------- what answers a raised check
ADAPTIVE_ATTACKS = ("bpda", "transfer", "square", "eot")  # robust_lightning.attacks.adaptive
# The attacks that answer each check where it is raised (Athalye et al., 2018; Carlini et al., 2019, Sec. 5): a
# randomized model is attacked with the gradient averaged over its draws (EoT) and scored over draws; masked or
# obfuscated gradients (a zero gradient, Square doing better than the gradient attacks, a forward that computes
# gradients, and the sanity checks' signs of masking) by the straight-through approximation of the parts that
# mask them (BPDA), a transfer from a surrogate without them, and Square, which needs no gradient, on every point.
ANSWERS: dict[str, tuple[str, ...]] = {
    "randomized": ("eot",),
    "zero_gradients": ("bpda", "transfer", "square"),
    "square_sr": ("bpda", "transfer", "square"),
    "dynamic": ("transfer", "square"),
    "eps_monotonic": ("bpda", "transfer", "square"),
    "unbounded": ("bpda", "transfer", "square"),
    "iterative_vs_one_step": ("bpda", "transfer", "square"),
}


def adaptive_plan(
    raised: Iterable[str], requested: str | Sequence[str], can_approximate: bool, has_surrogate: bool
) -> tuple[list[str], dict[str, str]]:
    """The adaptive attacks to run, in the order of ADAPTIVE_ATTACKS, and a note for each that a raised check asked
    for but that cannot run. ``raised``: the names of the checks raised. ``requested``: "auto" (what the raised
    checks call for), "none", or the names of attacks to run always (beside what "auto" adds, where "auto" is one
    of them). ``can_approximate``: the parts to approximate were named (``bpda``); ``has_surrogate``: a surrogate
    model was given, or those parts can be taken out of the model."""
    if isinstance(requested, str):
        requested = [requested]
    unknown = [name for name in requested if name not in (*ADAPTIVE_ATTACKS, "auto", "none")]
    if unknown or ("none" in requested and len(requested) > 1):
        raise ValueError(
            f"adaptive must be 'auto', 'none' or a list of {ADAPTIVE_ATTACKS} (with 'auto' among them to add what "
            f"the checks call for), got {list(requested)}"
        )
    wanted = {name for name in requested if name in ADAPTIVE_ATTACKS}
    if "auto" in requested:
        wanted |= {attack for check in raised for attack in ANSWERS.get(check, ())}
    needs = {
        "bpda": (can_approximate, "needs the parts of the model to approximate (option bpda)"),
        "transfer": (
            has_surrogate,
            "needs a surrogate model, or the parts of the model to take out of it (option bpda)",
        ),
    }
    notes = {name: needs[name][1] for name in wanted if name in needs and not needs[name][0]}
    return [name for name in ADAPTIVE_ATTACKS if name in wanted and name not in notes], notes
