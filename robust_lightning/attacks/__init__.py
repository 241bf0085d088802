"""Adversarial attacks on plain callables ``model(x) -> logits`` (no Lightning): APGD, FGSM(-RS), PGD."""

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
from .projections import NORMS, l1_projection, lp_norm, normalize, project, project_l1, project_l2, project_linf
from .simple import fgsm, pgd

__all__ = [
    "APGDResult",
    "LOSSES",
    "NORMS",
    "apgd",
    "dlr_loss",
    "dlr_targeted_loss",
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
]
