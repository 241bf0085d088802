"""AutoAttack (Croce & Hein, ICML 2020): the reference engine and our fast engine behind one API.

    adversary = AutoAttack(model, norm="Linf", eps=4 / 255, version="standard", seed=0, engine="fast")
    x_adv = adversary.run_standard_evaluation(x, y, bs=250)      # as with the reference code
    report = adversary.evaluate(x, y, bs=250)                    # per-point flags, per-attack accuracy, times

The class takes the calls of both reference codes unchanged (``AutoAttack`` docstring): the original
(github.com/fra31/auto-attack, which RobustBench pins: its constructor's arguments in its order, ``verbose``
lines and ``log_path``, ``attacks_to_run`` with ``version="custom"``, ``run_standard_evaluation(x, y, bs=250,
return_labels=False)``, x_adv) and the package pyautoattack 0.2.0 (keyword-only ``attacks=``,
``version="custom"``, ``seed=None``; ``run_standard_evaluation(x, y, batch_size=250)``, which returns (x_adv,
y_adv)); the attack budgets are set through the reference's attribute names (``adversary.apgd.n_restarts``,
``adversary.square.n_queries``, ...).

Both engines share the ensemble logic here: clean points only, attacks in order (standard: APGD-CE ->
APGD-T -> FAB-T -> Square), each attack only on the points that survived the previous ones, robust accuracy
as the per-point worst case. Every adversarial example an attack returns is re-checked here with an fp32
forward of the model as given before the point counts as broken, so an attack that ran a faster stand-in
(low precision, another memory layout, BatchNorm folded) can never claim a success that does not hold for
the model; and since such a false success also ended the point's attack early (no further targets,
restarts or queries), a point whose claim the check refutes goes through that attack again, on the model as
given, in fp32.

* ``engine="reference"`` runs the attacks of the ``pyautoattack`` package (a packaging of the reference code)
  unchanged (robust_lightning.attacks.reference_engine), one attack at a time on the survivors: its own batching
  of survivors in index order and its seed reset before every attack on every batch, so the result is the
  package's own.
* ``engine="fast"`` runs our implementations (robust_lightning.attacks: APGD, FAB-T, Square) with the same
  settings: input-only gradients, no host sync per iteration in the attack loops (APGD reads back only after
  iterations 1, 2, 4, 8, ..., when the rows of the points it broke leave the run; Square after its forward passes
  1, 2, 4, 8, ... and at most as many times more near its end, when the points it broke or that ran out of
  queries leave its batch), and survivors re-batched between target classes and restarts so broken points are
  not attacked again; while few survivors are left, several target classes (restarts) run in one batch of up
  to ``bs`` rows (:func:`batched_runs`), and Square evaluates several of each point's next queries in one pass
  (speculatively, with the one-at-a-time result).
  The attacks run a copy of the model with eval-mode BatchNorm folded into the convolutions before it (one op
  instead of two, forward and backward), and on the CPU give it inputs in the channels_last layout, where oneDNN's
  convolutions and pooling run faster (robust_lightning.attacks.stand_ins).

The reference's version "rand", for randomized defences: APGD-CE then APGD-DLR, one restart each, every iterate's
gradient averaged over 20 forward/backward passes (Expectation over Transformation, ``adversary.apgd.eot_iter``).
Its randomness check is not run, as in the reference, since the model is randomized by design. The version "plus"
(AA+) runs APGD-CE and APGD-DLR with 5 restarts, untargeted FAB with 5 restarts (:func:`fab_untargeted`, one
backward per class at each step), Square, APGD-T and FAB-T.

Quick modes (``version``): "apgd-t" (targeted APGD-DLR only, 40 iterations, 3 target classes: the paper's
sweeps) and "apgd-ce" (``n_iter``-step APGD-CE, e.g. 10 for checkpoint selection).

The fast engine's attacks are the rows of one table, :data:`ATTACKS` (name -> runner and what the ensemble needs to
know of it), from which the versions' names, "custom"'s choice and the dispatch come: a new attack is a runner and
a row.
"""

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from robust_lightning.console import tqdm

from . import checks as reference_checks
from . import reference_engine
from .adaptive import AdaptiveResult, bpda_attack, eot_attack, square_from_scratch, transfer_attack, without_parts
from .apgd import StopPoint, apgd
from .checks import Check, adaptive_plan
from .evaluation_state import EvaluationState
from .fab import fab_targeted, fab_untargeted
from .projections import NORMS, l1_projection
from .square import square_attack
from .stand_ins import attack_stand_in, folds_batchnorm, uses_channels_last

ENGINES = ("fast", "reference")
PRECISIONS = ("fp32", "tf32", "bf16")
VERSIONS = {  # names of ATTACKS (below, after their runners), in the order they run
    "standard": ("apgd-ce", "apgd-t", "fab-t", "square"),
    "rand": ("apgd-ce", "apgd-dlr"),  # for randomized defences: 20 EoT passes per iterate, one restart
    "plus": ("apgd-ce", "apgd-dlr", "fab", "square", "apgd-t", "fab-t"),  # AA+: more attacks and restarts
    "apgd-t": ("apgd-t",),
    "apgd-ce": ("apgd-ce",),
}


@dataclass
class AttackSettings:
    """One attack's budget, under the attribute names of pyautoattack's attack objects, so that code written for
    it (``adversary.apgd.n_restarts = 1``, ``adversary.square.n_queries = 1000``) works unchanged. Fields an
    attack has no use for are ignored, as on the reference's objects."""

    n_iter: int = 100
    n_restarts: int = 1
    n_target_classes: int = 9
    n_queries: int = 5000
    eot_iter: int = 1  # APGD's forward/backward passes averaged per iterate (Expectation over Transformation)


@dataclass
class AutoAttackReport:
    """The outcome of one evaluation. Per-point tensors are on the CPU, in the input's order."""

    norm: str
    eps: float
    version: str
    engine: str
    precision: str
    seed: int
    attacks: tuple[str, ...]
    channels_last: bool  # the attacks fed the model channels_last inputs (fast engine)
    batchnorm_folded: bool  # the attacks ran a copy of the model with BatchNorm folded (fast engine)
    clean: Tensor  # bool: correctly classified without attack
    robust: Tensor  # bool: correctly classified after every attack
    broken_by: list[str | None]  # per point: the attack that broke it ("clean" if misclassified anyway)
    robust_after: dict[str, float] = field(default_factory=dict)  # robust accuracy after each attack
    # per attack (fast engine): successes claimed by the attack that the fp32 check of the model refuted (those
    # points were attacked again in fp32); more than a rare borderline point means the stand-in misleads
    refuted: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    x_adv: Tensor | None = None
    # the reference's checks (robust_lightning.attacks.checks): a raised one says the robust accuracy may not hold
    checks: list[Check] = field(default_factory=list)
    # the adaptive attacks the raised checks called for (robust_lightning.attacks.adaptive), each on every point,
    # and why one they called for could not run
    adaptive: dict[str, AdaptiveResult] = field(default_factory=dict)
    adaptive_notes: dict[str, str] = field(default_factory=dict)

    @property
    def reported(self) -> Tensor:
        """Per point, the lowest of its robust figures: standard AutoAttack's (0 or 1) and each adaptive attack's
        (0 or 1, or EoT's share of draws)."""
        lowest = self.robust.float()
        for result in self.adaptive.values():
            lowest = torch.minimum(lowest, result.robust.float())
        return lowest

    @property
    def reported_robust_accuracy(self) -> float:
        """The robust accuracy to report: standard AutoAttack's where no adaptive attack ran, else the mean of the
        lowest figure per point."""
        return self.reported.mean().item()

    @property
    def clean_accuracy(self) -> float:
        return self.clean.float().mean().item()

    @property
    def robust_accuracy(self) -> float:
        return self.robust.float().mean().item()

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (accuracies as fractions)."""
        return {
            "norm": self.norm,
            "eps": self.eps,
            "version": self.version,
            "engine": self.engine,
            "precision": precision_note(self.precision),
            "seed": self.seed,
            "attacks": list(self.attacks),
            "channels_last": self.channels_last,
            "batchnorm_folded": self.batchnorm_folded,
            "num_points": len(self.clean),
            "clean_accuracy": self.clean_accuracy,
            "robust_accuracy": self.robust_accuracy,
            "robust_accuracy_after": dict(self.robust_after),
            "claims_refuted_in_fp32": dict(self.refuted),
            "seconds": dict(self.seconds),
            "total_seconds": sum(self.seconds.values()),
            "checks": {check.name: check.record() for check in self.checks},
            "adaptive": {
                **{
                    name: {"robust_accuracy": result.robust.float().mean().item(), "seconds": result.seconds}
                    | ({"notes": result.notes} if result.notes else {})
                    for name, result in self.adaptive.items()
                },
                **{name: {"not_run": note} for name, note in self.adaptive_notes.items()},
            },
            "reported_robust_accuracy": self.reported_robust_accuracy,
        }


def precision_note(precision: str) -> str:
    return {
        "fp32": "fp32 (TF32 off)",
        "tf32": "attacks with TF32 matmuls, successes verified in fp32",
        "bf16": "attacks under bf16 autocast, successes verified in fp32",
    }[precision]


@contextlib.contextmanager
def numerics(precision: str, device: torch.device) -> Iterator[None]:
    """Attack-time numerics; the fp32 verification runs outside this context, with TF32 off."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


L1_MIN_ITER = 3  # one iteration for each stage of the L1 eps schedule


class EvaluationStopped(Exception):
    """An evaluation given ``stop`` stopped because ``stop()`` said so, between two attacks or inside one (between
    its restarts or target classes, every 10 gradient passes of an APGD run, or every 50 passes of
    Square); its state file
    (``state_path``) holds every attack it finished, and the same call again runs only the others, an attack cut
    short from its start."""


class AutoAttack:
    """The standard AutoAttack ensemble (or a quick mode) against ``model``: [0, 1] inputs, logits out.

    Args:
        norm: the threat model's norm: "Linf", "L2" or "L1".
        eps: the threat model's radius.
        seed: reset before every attack on every batch, as the reference does; None draws one from the clock,
            as pyautoattack does (the report records it).
        verbose: :meth:`run_standard_evaluation`, :meth:`run_standard_evaluation_individual` and
            :meth:`clean_accuracy` print fra31's lines (accuracy before and after each attack, the total time,
            the largest perturbation). :meth:`evaluate` prints only through its ``progress``.
        attacks_to_run: with ``version="custom"`` only: the attacks to run, in order (of :data:`ATTACKS`); also
            settable as an attribute after construction, as fra31's README does.
        version: "standard", "rand" (randomized defences), "plus", a quick mode "apgd-t" / "apgd-ce" (see the
            module docstring), or "custom" with ``attacks_to_run`` (or ``attacks``).
        is_tf_model: fra31's TensorFlow adapter; only False (PyTorch models) is implemented.
        device: where the attacks run (default: the model's parameters' device).
        log_path: the verbose lines are also appended to this file, as fra31's ``Logger`` does.
        engine: "fast" (ours) or "reference" (pyautoattack 0.2.0, unchanged).
        precision: "fp32" (default, TF32 off), "tf32" or "bf16" (fast engine only); successes are always
            verified in fp32, and refuted ones attacked again in fp32.
        n_iter: overrides the version's iterations (quick modes).
        n_target_classes: overrides the version's target classes (quick modes).
        n_queries: Square's query budget.
        channels_last: fast engine only: give the model channels_last inputs. Default: on the CPU, where it
            measured faster (benchmarks/RESULTS.md); off elsewhere, where it has not been measured. The fp32
            verification of successes always sees the standard layout.
        fold_batchnorm: fast engine only (default on): attack a copy of the model with BatchNorm folded into
            the layers before it (:func:`~robust_lightning.attacks.stand_ins.folded_batchnorm`, made afresh by
            every ``evaluate``); successes are verified on the model as given.
        attacks: pyautoattack's name for ``attacks_to_run``.
        checks: run the reference's checks (:mod:`robust_lightning.attacks.checks`), as the reference does: on
            the first batch before the attacks, and Square's after them. :meth:`evaluate` reports them
            (``AutoAttackReport.checks``); :meth:`run_standard_evaluation` also warns of a raised one, as the
            reference does.
        adaptive: the adaptive attacks (:mod:`robust_lightning.attacks.adaptive`) run after the standard ones, on
            every point: "auto" (default) those that the raised checks call for
            (:data:`robust_lightning.attacks.checks.ANSWERS`), "none", or a list of names to run always ("auto"
            among them adds the others). None runs where no check is raised. The report keeps standard
            AutoAttack's figure (``robust_accuracy``), each adaptive attack's, and the lowest per point
            (``reported_robust_accuracy``).
        bpda: dotted names (``model.named_modules()``) of the parts of the model that mask its gradients (an input
            quantisation, a non-differentiable step): BPDA attacks the model with them approximated (the identity's
            gradient, or ``stand_ins[name]``'s), and the transfer attack a surrogate without them.
        stand_ins: differentiable modules standing in for the ``bpda`` parts, by name.
        surrogate: a model to transfer attacks from (default: the model without its ``bpda`` parts).
        eot_draws: the forward passes over which EoT scores a randomized model's adversarial examples.

    The reference codes' calls work unchanged. fra31/auto-attack: ``AutoAttack(model, norm='Linf', eps=.3,
    seed=None, verbose=True, attacks_to_run=[], version='standard', is_tf_model=False, device='cuda',
    log_path=None)`` (the same order; our defaults differ for eps, seed and device),
    ``run_standard_evaluation(x, y, bs=250, return_labels=False)`` (x_adv, or (x_adv, y_adv) with
    return_labels), ``run_standard_evaluation_individual`` and ``clean_accuracy``. pyautoattack 0.2.0
    (keyword-only ``AutoAttack(model, attacks=None, device="cpu", eps=0.3, norm="Linf", seed=None,
    version="standard")``): ``run_standard_evaluation(x, y, batch_size=250)`` returns (x_adv, y_adv), as that
    package does. y_adv is the model's prediction on x_adv. Budgets are set through ``self.apgd``,
    ``self.apgd_targeted``, ``self.fab`` and ``self.square`` (:class:`AttackSettings`); "custom" starts from the
    reference constructor's budgets (5 APGD restarts, 9 target classes). ``state_path`` resumes a stopped
    evaluation (:mod:`robust_lightning.attacks.evaluation_state`). Not implemented: ``is_tf_model=True`` (a
    clear error). One difference: L1 APGD always runs the 3/2/1 x eps schedule of the standard version, also
    under "custom", "rand" and "plus", where the reference turns it on only in the standard version.
    """

    def __init__(  # the arguments before engine in fra31/auto-attack's order, so positional calls work too
        self,
        model: Callable[[Tensor], Tensor],
        norm: str = "Linf",
        eps: float = 4 / 255,
        seed: int | None = 0,
        verbose: bool = True,
        attacks_to_run: list[str] | tuple[str, ...] = (),
        version: str = "standard",
        is_tf_model: bool = False,
        device: torch.device | str | None = None,
        log_path: str | Path | None = None,
        *,
        engine: str = "fast",
        precision: str = "fp32",
        n_iter: int | None = None,
        n_target_classes: int | None = None,
        n_queries: int = 5000,
        channels_last: bool | None = None,
        fold_batchnorm: bool | None = None,
        attacks: list[str] | None = None,
        checks: bool = True,
        adaptive: str | Sequence[str] = "auto",
        bpda: Sequence[str] = (),
        stand_ins: Mapping[str, nn.Module] | None = None,
        surrogate: Callable[[Tensor], Tensor] | None = None,
        eot_draws: int = 20,
    ):
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if version not in VERSIONS and version != "custom":  # custom: the attacks given, in that order
            raise ValueError(f"version must be one of {(*VERSIONS, 'custom')}, got {version!r}")
        if attacks is not None and attacks_to_run:
            raise ValueError(
                "give the attacks as attacks_to_run (fra31/auto-attack) or attacks (pyautoattack), not both"
            )
        custom_attacks = list(attacks if attacks is not None else attacks_to_run)
        if version != "custom" and custom_attacks:
            raise ValueError(
                f"the attacks to run are set by version={version!r}; give them with "
                "version='custom' only, as the reference codes require"
            )
        if is_tf_model:
            raise ValueError(
                "is_tf_model=True (fra31's TensorFlow adapter) is not implemented here; "
                "AutoAttack takes a PyTorch model (an nn.Module or a callable on tensors)"
            )
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if engine == "reference" and precision != "fp32":
            raise ValueError("the reference engine runs in fp32 only (as the package does)")
        if engine == "reference" and fold_batchnorm:
            raise ValueError("fold_batchnorm applies to the fast engine only; the reference runs the model as is")
        if eps <= 0:
            raise ValueError(f"eps must be positive, got {eps}")
        self.model, self.norm, self.eps, self.version = model, norm, float(eps), version
        self.seed = int(time.time()) if seed is None else int(seed)
        self.verbose, self.log_path, self.is_tf_model = verbose, log_path, is_tf_model
        self.engine, self.precision, self.checks = engine, precision, checks
        self._stop: Callable[[], bool] | None = None  # the running evaluation's (evaluate's stop)
        adaptive_plan((), adaptive, bool(bpda), True)  # a bad name is refused here, before any attack
        self.adaptive, self.bpda, self.stand_ins = adaptive, tuple(bpda), dict(stand_ins or {})
        self.surrogate, self.eot_draws = surrogate, eot_draws
        if device is None:
            parameter = next(iter(getattr(model, "parameters", lambda: iter(()))()), None)
            device = parameter.device if parameter is not None else "cpu"
        self.device = torch.device(device)
        self.channels_last = uses_channels_last(engine, self.device, channels_last)
        self.fold_batchnorm = folds_batchnorm(engine, fold_batchnorm)
        quick, standard = version in ("apgd-t", "apgd-ce"), version == "standard"
        apgd_iter = n_iter or (40 if version == "apgd-t" else 100)
        # the reference's constructor restarts APGD 5 times and targets 9 classes ("custom" keeps that); its
        # standard version (set_version) restarts once for Linf / L2 and targets 5 classes for L1
        one_restart = quick or version == "rand" or (standard and norm != "L1")
        self.apgd = AttackSettings(n_iter=apgd_iter, n_restarts=1 if one_restart else 5)
        if version == "rand":
            self.apgd.eot_iter = 20
        targets = 3 if quick else (5 if standard and norm == "L1" else 9)
        self.apgd_targeted = AttackSettings(n_iter=apgd_iter, n_target_classes=n_target_classes or targets)
        # untargeted FAB ("fab", in "plus" and "custom") restarts 5 times as the reference's constructor has it;
        # FAB-T runs once per target class, as the reference forces
        self.fab = AttackSettings(n_target_classes=9, n_restarts=1 if standard else 5)
        self.square = AttackSettings(n_queries=n_queries)
        self.attacks_to_run = custom_attacks if version == "custom" else list(VERSIONS[version])
        if self.attacks_to_run:  # "custom" may name them later, as an attribute
            self._check_settings()

    @property
    def attacks(self) -> tuple[str, ...]:
        return tuple(self.attacks_to_run)

    @property
    def n_iter(self) -> int:
        return self.apgd.n_iter

    @property
    def n_target_classes(self) -> int:
        return self.apgd_targeted.n_target_classes

    @property
    def epsilon(self) -> float:  # pyautoattack's name
        return self.eps

    def _check_settings(self) -> None:
        """The attacks and budgets can be changed after construction (as on the reference): checked per run."""
        if not self.attacks_to_run:
            raise ValueError(
                "version='custom' needs the attacks to run: AutoAttack(..., attacks_to_run=[...]) or "
                f"adversary.attacks_to_run = [...], of {tuple(ATTACKS)}"
            )
        unknown = [attack for attack in self.attacks_to_run if attack not in ATTACKS]
        if unknown:
            raise ValueError(f"attacks must be a non-empty list of {tuple(ATTACKS)}, got {self.attacks_to_run}")
        theirs = reference_engine.REFERENCE_ATTACKS
        if self.engine == "reference" and any(attack not in theirs for attack in self.attacks_to_run):
            raise ValueError(f"engine='reference' runs pyautoattack's attacks {theirs} only, got {self.attacks_to_run}")
        for settings in (self.apgd, self.apgd_targeted):
            if self.norm == "L1" and settings.n_iter < L1_MIN_ITER:
                raise ValueError(
                    f"L1 APGD splits its iterations 30/30/40 % over 3, 2 and 1 x eps: n_iter must be "
                    f"at least {L1_MIN_ITER}, got {settings.n_iter}"
                )
        if self.engine == "fast" and (self.apgd_targeted.n_restarts != 1 or self.square.n_restarts != 1):
            raise ValueError(
                "the fast engine runs APGD-T and Square with one restart (as the standard version "
                "does); engine='reference' runs more"
            )

    # ------------------------------------------------------------------------------------------- public
    def run_standard_evaluation(
        self,
        x: Tensor,
        y: Tensor,
        bs: int | None = None,
        return_labels: bool = False,
        *,
        batch_size: int | None = None,
        state_path: Path | str | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The adversarial images (the clean image where no attack succeeded), as the reference codes return
        them: x_adv (fra31/auto-attack, ``bs=``), (x_adv, y_adv) with ``return_labels=True`` or when called as
        pyautoattack 0.2.0 is, with ``batch_size=``; y_adv is the model's prediction on x_adv. With ``verbose``,
        fra31's lines: the attacks, the initial accuracy, per attack the points it broke and the robust accuracy
        after it, the largest perturbation and the robust accuracy. ``state_path``: the reference's resume file
        (see :meth:`evaluate`)."""
        bs = self._batch_size(bs, batch_size)
        log = self.log if self.verbose else None
        if log:
            log(f"using {self.version} version including {', '.join(self.attacks_to_run)}.")
        report = self.evaluate(x, y, bs=bs, progress=log, state_path=state_path)  # it warns of raised checks
        x_adv = report.x_adv
        assert x_adv is not None  # evaluate() reports the adversarial images
        if log:
            delta = (x_adv - x.to(x_adv.device)).flatten(1)
            size = {"Linf": delta.abs().amax(1), "L2": delta.norm(dim=1), "L1": delta.abs().sum(1)}[self.norm]
            log(
                f"max {self.norm} perturbation: {size.max():.5f}, nan in tensor: {x_adv.isnan().sum()}, "
                f"max: {x_adv.max():.5f}, min: {x_adv.min():.5f}"
            )
            log(f"robust accuracy: {report.robust_accuracy:.2%}")
        if return_labels or batch_size is not None:
            return x_adv, self._predictions(x_adv, bs)
        return x_adv

    def run_standard_evaluation_individual(
        self, x: Tensor, y: Tensor, bs: int | None = None, return_labels: bool = False, *, batch_size: int | None = None
    ) -> dict[str, Tensor | tuple[Tensor, Tensor]]:
        """Each attack on its own on all clean points, as the reference codes do: attack name -> what
        :meth:`run_standard_evaluation` returns for it. With ``verbose``, the robust accuracy of each."""
        ensemble, verbose = self.attacks_to_run, self.verbose
        if verbose:
            self.log(f"using {self.version} version including {', '.join(ensemble)}")
        try:
            self.verbose, results = False, {}
            for attack in ensemble:
                started = time.perf_counter()
                self.attacks_to_run = [attack]
                x_adv, y_adv = self.run_standard_evaluation(x, y, bs, return_labels=True, batch_size=batch_size)
                results[attack] = (x_adv, y_adv) if return_labels or batch_size is not None else x_adv
                if verbose:
                    accuracy = (y_adv == y.to(y_adv.device)).float().mean().item()
                    self.log(
                        f"robust accuracy by {attack.upper()}\t{accuracy:.2%}\t"
                        f"(time attack: {time.perf_counter() - started:.1f} s)"
                    )
            return results
        finally:
            self.attacks_to_run, self.verbose = ensemble, verbose

    def clean_accuracy(self, x: Tensor, y: Tensor, bs: int = 250) -> float:
        """The fraction of ``x`` classified as ``y`` (fp32), as the reference's method."""
        accuracy = self._correct(x.float(), y.long(), bs).float().mean().item()
        if self.verbose:
            self.log(f"clean accuracy: {accuracy:.2%}")
        return accuracy

    def log(self, line: str) -> None:
        """Print ``line`` and append it to ``log_path`` when set, as fra31's ``Logger``."""
        print(line, flush=True)
        if self.log_path is not None:
            with open(self.log_path, "a") as log:
                log.write(line + "\n")

    def evaluate(
        self,
        x: Tensor,
        y: Tensor,
        bs: int = 250,
        progress: Callable[[str], None] | None = None,
        progress_bar: bool = False,
        state_path: Path | str | None = None,
        stop: Callable[[], bool] | None = None,
        checked_elsewhere: Sequence[Check] = (),
    ) -> AutoAttackReport:
        """Run the ensemble on ``x`` (N, C, H, W) in [0, 1] with labels ``y`` (N,), ``bs`` points at a time.
        ``progress`` receives fra31's verbose lines (the initial accuracy, per attack the points it broke and the
        robust accuracy after it); ``progress_bar`` shows a bar over the attacks (rank zero). ``state_path``: the
        reference's resume file (:mod:`robust_lightning.attacks.evaluation_state`): the attacks already run are
        skipped, and the points they broke stay broken (their ``x_adv`` is the clean image, as in the
        reference; ``broken_by`` names the attack, or says "before the resume" for a reference's state file, which
        does not record it). ``stop``: a job's stop signal, asked before each attack and each adaptive attack,
        and inside the fast engine's attacks and the adaptive ones (:meth:`stop_point`); where it says so,
        :class:`EvaluationStopped` is raised, the attacks finished so far kept in ``state_path``.
        ``checked_elsewhere``: checks of the model made outside this call (the evaluation callback's sanity
        checks, or the checks of an earlier batch), which decide the adaptive attacks too.

        The model is attacked in the mode it is given in, as the reference does: one in train mode (dropout, or
        BatchNorm's batch statistics) is attacked so, with a warning."""
        if x.min() < 0 or x.max() > 1:
            raise ValueError("AutoAttack takes images in [0, 1]; normalisation belongs inside the model")
        self._check_settings()
        if getattr(self.model, "training", False):  # a module (a plain callable has no training mode)
            warnings.warn(
                "AutoAttack: the model is in train mode (dropout or BatchNorm's batch statistics on) and is attacked "
                "as given, as the reference does: call model.eval() first, unless its randomness is part of the "
                "defence (the check randomized then raises, and EoT answers it)",
                stacklevel=2,
            )
        state = None
        if state_path is not None:
            state = EvaluationState.open(state_path, self.attacks, len(x), self.norm, self.eps)
        self._stop = stop
        try:
            return self._evaluate(x.float(), y.long(), bs, progress, progress_bar, state, checked_elsewhere)
        finally:
            self._stop = None

    def stop_point(self) -> None:
        """Raise :class:`EvaluationStopped` where the running evaluation's ``stop`` says so: the fast engine's
        attacks and the adaptive attacks call it between their runs or batches, every 10 gradient passes of APGD and
        every 50 passes of Square, so that a stop does not wait for a whole attack."""
        if self._stop is not None and self._stop():
            raise EvaluationStopped("stopped inside an attack; it runs again from its start")

    @staticmethod
    def _batch_size(bs: int | None, batch_size: int | None) -> int:
        if bs is not None and batch_size is not None:
            raise ValueError("give bs (fra31/auto-attack) or batch_size (pyautoattack), not both")
        return bs or batch_size or 250

    def _stand_in(self) -> tuple[Callable[[Tensor], Tensor], bool]:
        """:func:`attack_stand_in` of the model, made per evaluation, so that it has the model's current weights."""
        return attack_stand_in(self.model, self.fold_batchnorm, self.channels_last)

    # ------------------------------------------------------------------------------------------ ensemble
    def _evaluate(
        self,
        x: Tensor,
        y: Tensor,
        bs: int,
        progress: Callable[[str], None] | None,
        progress_bar: bool,
        state: EvaluationState | None,
        checked_elsewhere: Sequence[Check] = (),
    ) -> AutoAttackReport:
        started = time.perf_counter()
        self._zero_starts, self._starts = torch.zeros((), dtype=torch.long, device=self.device), 0
        stand_in, folded = self._stand_in() if self.engine == "fast" else (self.model, False)
        clean = self._correct(x, y, bs)
        robust = clean.clone()
        broken_by: list[str | None] = [None if ok else "clean" for ok in clean.tolist()]
        x_adv = x.clone()
        seconds = {"clean": time.perf_counter() - started}
        if progress is not None:
            progress(f"initial accuracy: {clean.float().mean().item():.2%}")
        if state is not None and state.resumed:
            robust = self._restored_flags(state, clean)
            self._zero_starts += state.zero_gradient_starts[0]
            self._starts = state.zero_gradient_starts[1]
            for i in (clean & ~robust).nonzero().flatten().tolist():
                broken_by[i] = state.broken_by[i] if state.broken_by is not None else "before the resume"
            if progress is not None:
                progress(
                    f"robust accuracy at the time of restoring the state: {robust.float().mean().item():.2%}; "
                    f"already run: {', '.join(a for a in self.attacks if a in state.run_attacks)}. Only the "
                    "adversarial examples of this run are returned."
                )
        elif state is not None:
            state.robust_flags, state.clean_accuracy = clean.tolist(), clean.float().mean().item()
            state.broken_by = list(broken_by)
            state.save()
        checks = []
        if self.checks:
            started = time.perf_counter()
            checks = self._checks_before_attacks(x[:bs], y[:bs], clean[:bs])
            seconds["checks"] = time.perf_counter() - started
            self._warn_of(checks)  # before the attacks, as the reference does
        attacks = self._attacks_the_classes_allow(x[:1])
        attacks_started = time.perf_counter()
        robust_after: dict[str, float] = {}
        refuted: dict[str, int] = {}
        bar = tqdm(self.attacks, desc="autoattack", unit="attack", leave=False, disable=not progress_bar)
        for attack in bar:
            bar.set_postfix_str(attack)
            if (state is not None and attack in state.run_attacks) or attack not in attacks:
                robust_after[attack] = robust.float().mean().item()
                if state is not None and attack in state.run_attacks:
                    robust_after[attack] = state.robust_accuracy_after.get(attack, robust_after[attack])
                continue
            if self._stop is not None and self._stop():
                raise EvaluationStopped(f"stopped before {attack}; {len(robust_after)} attacks done")
            started = time.perf_counter()
            survivors = robust.nonzero().flatten()
            if len(survivors):
                candidates, claimed_robust = self._attack(attack, stand_in, x[survivors], y[survivors], bs)
                # a success counts only if an fp32 forward of the model as given agrees
                held = self._correct(candidates, y[survivors], bs)
                if self.engine == "fast":
                    # a success the check refutes also ended the point's attack early (its other targets,
                    # restarts, queries): those points get this attack again, on the model as given, in fp32
                    assert claimed_robust is not None  # the fast engine's attacks report their flags
                    redo = (~claimed_robust & held).nonzero().flatten()
                    refuted[attack] = len(redo)
                    if len(redo):
                        again, _ = self._attack(attack, self.model, x[survivors[redo]], y[survivors[redo]], bs, "fp32")
                        candidates[redo] = again
                        held[redo] = self._correct(again, y[survivors[redo]], bs)
                newly_broken = survivors[~held]
                robust[newly_broken] = False
                x_adv[newly_broken] = candidates[~held].to(x_adv.device)
                for i in newly_broken.tolist():
                    broken_by[i] = attack
                if progress is not None:
                    progress(f"{attack} - {len(newly_broken)} out of {len(survivors)} successfully perturbed")
            robust_after[attack] = robust.float().mean().item()
            seconds[attack] = time.perf_counter() - started
            if state is not None:
                state.robust_flags, state.broken_by = robust.tolist(), list(broken_by)
                state.zero_gradient_starts = (int(self._zero_starts), self._starts)
                state.run_attacks.append(attack)
                state.robust_accuracy_after[attack] = robust_after[attack]
                state.save()
            if progress is not None:
                progress(
                    f"robust accuracy after {attack.upper()}: {robust_after[attack]:.2%} "
                    f"(total time {time.perf_counter() - attacks_started:.1f} s)"
                )
        after: list[Check] = []
        if self.checks:
            after.append(reference_checks.square_sr({"clean": clean.float().mean().item(), **robust_after}))
        if self._starts:  # free: the DLR attacks' own start gradients, so made on every batch
            after.append(reference_checks.zero_gradient_starts(int(self._zero_starts), self._starts))
        self._warn_of(after)
        checks += after
        raised = {check.name for check in [*checks, *checked_elsewhere] if check.raised}
        can_transfer = self.surrogate is not None or bool(self.bpda)
        plan, notes = adaptive_plan(raised, self.adaptive, bool(self.bpda), can_transfer)
        adaptive = {}
        for name in plan:
            if self._stop is not None and self._stop():
                raise EvaluationStopped(f"stopped before the adaptive attack {name}")
            adaptive[name] = self._adaptive_attack(name, x, y, bs)
            seconds[f"adaptive_{name}"] = adaptive[name].seconds  # apart from a standard attack of the same name
            if progress is not None:
                progress(f"{name} (adaptive): robust accuracy {adaptive[name].robust.mean().item():.2%}")
        return AutoAttackReport(
            norm=self.norm,
            eps=self.eps,
            version=self.version,
            engine=self.engine,
            precision=self.precision,
            seed=self.seed,
            attacks=self.attacks,
            channels_last=self.channels_last,
            batchnorm_folded=folded,
            clean=clean.cpu(),
            robust=robust.cpu(),
            broken_by=broken_by,
            robust_after=robust_after,
            refuted=refuted,
            seconds=seconds,
            x_adv=x_adv,
            checks=checks,
            adaptive=adaptive,
            adaptive_notes=notes,
        )

    def _warn_of(self, checks: list[Check]) -> None:
        """A raised check as the reference says it: a line of the log where ``log_path`` is set, else a warning."""
        for check in checks:
            if not check.raised:
                continue
            if self.log_path is not None:
                self.log(f"Warning: AutoAttack check {check.name}: {check.advice}")
            else:
                warnings.warn(f"AutoAttack check {check.name}: {check.advice}", stacklevel=4)

    def _attacks_the_classes_allow(self, x: Tensor) -> tuple[str, ...]:
        """The attacks to run: those of the version that the model's class count allows. The DLR loss needs 3
        classes and its targeted form 4; with fewer the attacks that use them are left out, with a warning (the
        reference runs them and fails), and a targeted attack aims at no more targets than there are other
        classes."""
        with numerics("fp32", self.device):
            classes = clean_logits(self.model, x.to(self.device)).shape[1]
        left_out = [attack for attack in self.attacks if classes < ATTACKS[attack].min_classes]
        if left_out:
            warnings.warn(
                f"AutoAttack: the model has {classes} classes, too few for {', '.join(left_out)} (the DLR loss needs "
                "3 classes and its targeted form 4): left out, the others run",
                stacklevel=4,
            )
        for name in {row.settings for row in ATTACKS.values() if row.targeted}:  # apgd_targeted, fab
            settings = getattr(self, name)
            settings.n_target_classes = min(settings.n_target_classes, max(classes - 1, 1))
        return tuple(attack for attack in self.attacks if attack not in left_out)

    def _adaptive_attack(self, name: str, x: Tensor, y: Tensor, bs: int) -> AdaptiveResult:
        """One adaptive attack (robust_lightning.attacks.adaptive) on every point, with this evaluation's budgets,
        on the model as given."""
        model = cast(nn.Module, self.model)
        x, y = x.to(self.device), y.to(self.device)
        norm, eps, seed, n_iter = self.norm, self.eps, self.seed, self.apgd.n_iter
        targets = self.apgd_targeted.n_target_classes
        with numerics("fp32", self.device):
            if name == "bpda":
                return bpda_attack(
                    model, x, y, parts=self.bpda, stand_ins=self.stand_ins, norm=norm, eps=eps, n_iter=n_iter,
                    n_target_classes=targets, seed=seed, bs=bs, stop_point=self.stop_point,
                )  # fmt: skip
            if name == "transfer":
                surrogate = self.surrogate or without_parts(model, self.bpda, self.stand_ins)
                return transfer_attack(
                    model, surrogate, x, y, norm=norm, eps=eps, n_iter=n_iter, n_target_classes=targets, seed=seed,
                    bs=bs, stop_point=self.stop_point,
                )  # fmt: skip
            if name == "eot":
                return eot_attack(
                    model, x, y, norm=norm, eps=eps, draws=self.eot_draws, n_iter=n_iter, seed=seed, bs=bs,
                    stop_point=self.stop_point,
                )  # fmt: skip
            return square_from_scratch(
                model, x, y, norm=norm, eps=eps, n_queries=self.square.n_queries, seed=seed, bs=bs,
                stop_point=self.stop_point,
            )  # fmt: skip

    @staticmethod
    def _restored_flags(state: EvaluationState, clean: Tensor) -> Tensor:
        """The robust flags of a state, checked against this run's clean pass: a point robust there but
        misclassified here means another model or other points."""
        restored = torch.tensor(state.robust_flags, dtype=torch.bool, device=clean.device)
        wrong = (restored & ~clean).nonzero().flatten()
        if len(wrong):
            raise ValueError(
                f"the state in {state.path} counts {len(wrong)} point(s) as robust that the model misclassifies "
                f"without attack (the first: {wrong[0].item()}): it was made with another model or other points; "
                "give another state_path"
            )
        return restored

    def _checks_before_attacks(self, x: Tensor, y: Tensor, clean: Tensor) -> list[Check]:
        """The reference's checks on the first batch, before the attacks (fra31/auto-attack's
        ``run_standard_evaluation``), on the model as given in fp32. The fast engine's DLR attacks count zero
        gradients at every start, as the reference does inside APGD, on every batch. For the reference engine
        zero_gradients is computed here as the reference does it: on the points the attack gets (those
        ``clean``ly classified), at APGD's random start, with the DLR loss of the first DLR attack (APGD-T:
        towards the highest other class); it is not run where no DLR attack is."""
        x, y = x.to(self.device), y.to(self.device)
        with numerics("fp32", self.device):
            output_range = reference_checks.range_output(self.model, x)
            num_classes = output_range.figures["num_classes"]
            found = [
                # as in the reference, the rand version, made for randomized models, does not check for them
                *([] if self.version == "rand" else [reference_checks.randomized(self.model, x, y)]),
                output_range,
                reference_checks.dynamic(self.model, x),
                reference_checks.n_classes(
                    num_classes, self.attacks, self.apgd_targeted.n_target_classes, self.fab.n_target_classes
                ),
            ]
            # the fast engine's DLR attacks count zero gradients at each of their starts (_count_zero_gradients)
            if self.engine == "reference" and num_classes > 3:
                found += reference_engine.zero_gradients(self, x[clean.to(x.device)], y[clean.to(x.device)])
        return found

    def _correct(self, x: Tensor, y: Tensor, bs: int) -> Tensor:
        """fp32 (TF32 off) predictions == labels, batch by batch, as a bool tensor on x's device."""
        return self._predictions(x, bs) == y

    @torch.no_grad()
    def _predictions(self, x: Tensor, bs: int) -> Tensor:
        """fp32 (TF32 off) predicted classes, batch by batch, on x's device."""
        with numerics("fp32", self.device):
            return torch.cat(
                [self.model(x[i : i + bs].to(self.device)).float().argmax(1).to(x.device) for i in range(0, len(x), bs)]
            )

    def _attack(
        self,
        attack: str,
        model: Callable[[Tensor], Tensor],
        x: Tensor,
        y: Tensor,
        bs: int,
        precision: str | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The attack's candidate images and, for the fast engine, its own robust flags (``model`` attacked at
        ``precision``)."""
        if self.engine == "reference":
            with numerics("fp32", self.device):  # TF32 off: PyTorch lets cuDNN convolutions use it by default
                return reference_engine.reference_attack(self, attack, x, y, bs), None
        images, robust = [], []
        for i in range(0, len(x), bs):
            xb, yb = x[i : i + bs].to(self.device), y[i : i + bs].to(self.device)
            with numerics(precision or self.precision, self.device):
                candidates, still = ATTACKS[attack].run(self, model, xb, yb, bs)
            images.append(candidates.detach().float().to(x.device))
            robust.append(still.to(x.device))
        return torch.cat(images), torch.cat(robust)

    def _count_zero_gradients(self, result: Any, loss: str | None) -> None:
        """The reference's zero_gradients at an APGD start of a DLR attack, summed on the device (no read back)."""
        if loss in ("dlr", "dlr-targeted") and result.zero_gradient is not None:
            self._zero_starts = self._zero_starts + result.zero_gradient.sum()
            self._starts += len(result.zero_gradient)


# --------------------------------------------------------------------------------------- the attacks
# Each attack of the fast engine is a runner, run(adversary, model, x, y, bs): it attacks the points x (labels y, on
# the adversary's device, at most bs rows at a time) on ``model`` with the adversary's norm, eps, seed and budgets,
# and returns the candidate images (x where it failed) and the robust flags. The ensemble (AutoAttack._evaluate)
# runs it on the survivors, batch by batch, and checks its successes in fp32 on the model as given.
Runner = Callable[["AutoAttack", Callable[[Tensor], Tensor], Tensor, Tensor, int], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Attack:
    """One row of :data:`ATTACKS`: an attack's runner and what the ensemble needs to know of it. ``settings``: the
    adversary's :class:`AttackSettings` that hold its budget (``adversary.apgd``, ...); ``targeted``: it aims at
    ``settings.n_target_classes`` other classes, which the model's class count caps; ``min_classes``: the fewest
    classes it can run with (the DLR loss needs 3, its targeted form 4), fewer leaves it out with a warning."""

    run: Runner
    settings: str
    targeted: bool = False
    min_classes: int = 2


def seeded_generator(adversary: "AutoAttack") -> torch.Generator:
    """The generator of one attack on one batch, seeded afresh each time, as the reference resets its seed."""
    return torch.Generator(device=adversary.device).manual_seed(adversary.seed)


def clean_logits(model: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x).float()


def apgd_run(
    adversary: "AutoAttack",
    model: Callable[[Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    points: Tensor,
    generator: torch.Generator,
    n_iter: int,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """One APGD run (x_adv, robust) on rows of the points ``points`` (a point's rows leave the run once one
    breaks it); for L1 the reference's 3/2/1 x eps schedule (30/30/40 % of the iterations) from a random
    point, each stage starting from the previous stage's best point (only a break at eps, in the last stage,
    counts).

    One known difference: the reference re-projects each stage's start as a correction (``x_init +=``),
    which leaves ~1e-8 residues where coordinates are zeroed, and its initial step sparsity counts them
    (the start's L0 distance); ours starts exactly sparse, so its first steps may be sparser. Matching it
    would need the reference's own projection bit for bit (ours agrees to float error only)."""
    norm, eps = adversary.norm, adversary.eps
    if norm != "L1":
        result = apgd(
            model,
            x,
            y,
            norm=norm,
            eps=eps,
            n_iter=n_iter,
            random_start=True,
            generator=generator,
            exit_broken=points,
            stop_point=adversary.stop_point,
            **kwargs,
        )
        adversary._count_zero_gradients(result, kwargs.get("loss"))
        return result.x_adv, result.robust
    stages = [math.ceil(0.3 * n_iter), math.ceil(0.3 * n_iter)]
    stages.append(n_iter - sum(stages))
    noise = torch.randn(x.shape, generator=generator, device=generator.device).to(x.device)
    start = x + l1_projection(x, noise, 3 * eps)
    for factor, stage_iter in zip((3, 2, 1), stages):
        start = x + l1_projection(x, start - x, factor * eps)
        result = apgd(
            model,
            x,
            y,
            norm="L1",
            eps=factor * eps,
            n_iter=stage_iter,
            x_init=start,
            generator=generator,
            exit_broken=points if factor == 1 else None,
            stop_point=adversary.stop_point,
            **kwargs,
        )
        if factor == 3:  # the run's start
            adversary._count_zero_gradients(result, kwargs.get("loss"))
        start = result.x_best
    return result.x_adv, result.robust


def run_apgd_ce(
    adversary: "AutoAttack", model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, bs: int
) -> tuple[Tensor, Tensor]:
    return _apgd_untargeted(adversary, model, x, y, bs, "ce")


def run_apgd_dlr(
    adversary: "AutoAttack", model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, bs: int
) -> tuple[Tensor, Tensor]:
    return _apgd_untargeted(adversary, model, x, y, bs, "dlr")


def _apgd_untargeted(
    adversary: "AutoAttack", model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, bs: int, loss: str
) -> tuple[Tensor, Tensor]:
    generator, settings = seeded_generator(adversary), adversary.apgd

    def attack(rows: Tensor, restarts: Tensor) -> tuple[Tensor, Tensor]:  # each row its own random start
        return apgd_run(
            adversary, model, x[rows], y[rows], rows, generator, settings.n_iter, loss=loss, eot_iter=settings.eot_iter
        )

    return batched_runs(attack, x, range(settings.n_restarts), bs, adversary.stop_point)


def run_apgd_t(
    adversary: "AutoAttack", model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, bs: int
) -> tuple[Tensor, Tensor]:
    generator, settings = seeded_generator(adversary), adversary.apgd_targeted
    ranked = clean_logits(model, x).sort(dim=1)[1]  # target of rank r: the r-th highest clean logit

    def attack(rows: Tensor, ranks: Tensor) -> tuple[Tensor, Tensor]:
        target = ranked[rows, ranked.shape[1] - ranks]
        return apgd_run(
            adversary,
            model,
            x[rows],
            y[rows],
            rows,
            generator,
            settings.n_iter,
            loss="dlr-targeted",
            y_target=target,
            eot_iter=settings.eot_iter,
        )

    return batched_runs(attack, x, range(2, settings.n_target_classes + 2), bs, adversary.stop_point)


def run_fab(
    adversary: "AutoAttack", model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, bs: int
) -> tuple[Tensor, Tensor]:
    generator = seeded_generator(adversary)
    restarts = range(adversary.fab.n_restarts)  # restarts after the first start at random points
    return _fab_runs(
        adversary,
        model,
        x,
        y,
        bs,
        fab_untargeted,
        restarts,
        lambda ids: {"random_start": ids > 0, "generator": generator},
    )


def run_fab_t(
    adversary: "AutoAttack", model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, bs: int
) -> tuple[Tensor, Tensor]:
    ranks = range(2, adversary.fab.n_target_classes + 2)
    return _fab_runs(adversary, model, x, y, bs, fab_targeted, ranks, lambda ids: {"target_rank": ids})


def _fab_runs(
    adversary: "AutoAttack",
    model: Callable[[Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    bs: int,
    fab: Callable[..., Any],
    runs: range,
    run_arguments: Callable[[Tensor], dict[str, Any]],
) -> tuple[Tensor, Tensor]:
    """FAB's runs (restarts, or target ranks) through :func:`batched_runs`; ``run_arguments`` gives a batch's
    rows the arguments of their runs."""
    logits = clean_logits(model, x)

    def attack(rows: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        result = fab(
            model,
            x[rows],
            y[rows],
            norm=adversary.norm,
            eps=adversary.eps,
            n_iter=adversary.fab.n_iter,
            logits_clean=logits[rows],
            **run_arguments(ids),
        )
        return result.x_adv, result.robust

    return batched_runs(attack, x, runs, bs, adversary.stop_point)


def run_square(
    adversary: "AutoAttack", model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, bs: int
) -> tuple[Tensor, Tensor]:
    result = square_attack(
        model,
        x,
        y,
        norm=adversary.norm,
        eps=adversary.eps,
        n_queries=adversary.square.n_queries,
        p_init=0.8,
        generator=seeded_generator(adversary),
        batch_size=bs,
        stop_point=adversary.stop_point,
    )
    return torch.where(result.robust.view(-1, *[1] * (x.dim() - 1)), x, result.x_adv), result.robust


# The attacks by the reference's names: the versions (VERSIONS), "custom"'s attacks_to_run, the dispatch of the fast
# engine, the class counts each needs and the callback's results columns all come from here. A new attack is a
# runner and a row.
ATTACKS: dict[str, Attack] = {
    "apgd-ce": Attack(run_apgd_ce, "apgd"),
    "apgd-dlr": Attack(run_apgd_dlr, "apgd", min_classes=3),
    "apgd-t": Attack(run_apgd_t, "apgd_targeted", targeted=True, min_classes=4),
    "fab": Attack(run_fab, "fab"),
    "fab-t": Attack(run_fab_t, "fab", targeted=True),
    "square": Attack(run_square, "square"),
}


def batched_runs(
    attack: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    x: Tensor,
    runs: range,
    bs: int,
    stop_point: StopPoint = lambda: None,
) -> tuple[Tensor, Tensor]:
    """Attack runs one after the other (restarts, or target ranks) on the points not broken yet; the
    adversarial images (``x`` where no run succeeded) and the robust flags.

    ``attack(rows, run_ids)`` attacks the points ``x[rows]``, row i in run ``run_ids[i]`` (a target rank, a
    restart), and returns (candidates, robust) per row. Runs go in order, as in the reference, and a point
    broken in one run is not attacked in the later ones. While few points are left, consecutive runs are
    batched: each survivor is repeated once per run, up to ``bs`` rows, so a small survivor set still fills
    the device's batch. A point broken in several runs of one batch keeps the earliest run's image.
    ``stop_point()`` is called before each batch of runs (it raises to stop).
    """
    x_adv, robust = x.clone(), torch.ones(len(x), dtype=torch.bool, device=x.device)
    pending = list(runs)
    while pending:
        stop_point()
        todo = robust.nonzero().flatten()
        if not len(todo):
            break
        # as few batches as bs allows, filled evenly (rather than a small last one, which uses the cores less well)
        n_batches = -(-len(pending) // max(1, bs // len(todo)))
        per_batch = -(-len(pending) // n_batches)
        group, pending = pending[:per_batch], pending[per_batch:]
        rows = todo.repeat(len(group))  # run-major: the first len(todo) rows belong to group[0]
        run_ids = torch.tensor(group, device=x.device).repeat_interleave(len(todo))
        candidates, still = attack(rows, run_ids)
        broken = ~still.view(len(group), len(todo))
        first = broken.to(torch.uint8).argmax(0)  # the earliest run that broke each point (argmax: first max)
        hit = broken.any(0)
        points = torch.arange(len(todo), device=x.device)
        chosen = candidates.view(len(group), len(todo), *x.shape[1:])[first, points]
        x_adv[todo[hit]] = chosen[hit]
        robust[todo[hit]] = False
    return x_adv, robust
