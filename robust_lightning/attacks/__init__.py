"""Adversarial attacks on plain callables ``model(x) -> logits`` (no Lightning): APGD, FAB-T, Square, FGSM(-RS),
PGD, the spatial grid attack, and the AutoAttack ensemble built from them (or run by the reference package)."""

from .adaptive import (
    AdaptiveResult,
    bpda_attack,
    eot_attack,
    square_from_scratch,
    straight_through,
    transfer_attack,
    without_parts,
)
from .apgd import (
    LOSSES,
    APGDResult,
    apgd,
    dlr_loss,
    dlr_targeted_loss,
    input_gradient,
    per_sample_loss,
    predicted_correct,
    random_start_point,
)
from .ensemble import AutoAttack, AutoAttackReport, EvaluationStopped
from .fab import FABResult, fab_targeted
from .projections import NORMS, l1_projection, lp_norm, normalize, project, project_l1, project_l2, project_linf
from .simple import fgsm, pgd
from .spatial import SpatialResult, spatial_grid, spatial_grid_attack
from .square import SquareResult, square_attack

__all__ = [
    "LOSSES",
    "NORMS",
    "APGDResult",
    "AdaptiveResult",
    "AutoAttack",
    "AutoAttackReport",
    "EvaluationStopped",
    "FABResult",
    "SpatialResult",
    "SquareResult",
    "apgd",
    "bpda_attack",
    "dlr_loss",
    "dlr_targeted_loss",
    "eot_attack",
    "fab_targeted",
    "fgsm",
    "input_gradient",
    "l1_projection",
    "lp_norm",
    "normalize",
    "per_sample_loss",
    "pgd",
    "predicted_correct",
    "project",
    "project_l1",
    "project_l2",
    "project_linf",
    "random_start_point",
    "spatial_grid",
    "spatial_grid_attack",
    "square_attack",
    "square_from_scratch",
    "straight_through",
    "transfer_attack",
    "without_parts",
]
