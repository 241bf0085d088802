"""AutoAttack's reference engine: the attacks of the ``pyautoattack`` package (a packaging of fra31/auto-attack, the
reference code of Croce & Hein, ICML 2020) run unchanged, one attack at a time on the survivors, with the budgets
set on our ``AutoAttack`` (robust_lightning.attacks.ensemble), which keeps the ensemble logic of both engines."""

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import checks as reference_checks
from .apgd import input_gradient, random_start_point
from .checks import Check

if TYPE_CHECKING:
    from .ensemble import AutoAttack

# the attacks the package has, by the reference's names
REFERENCE_ATTACKS = ("apgd-ce", "apgd-dlr", "apgd-t", "fab", "fab-t", "square")


def reference_attack(adversary: "AutoAttack", attack: str, x: Tensor, y: Tensor, bs: int) -> Tensor:
    """One attack of pyautoattack's standard AutoAttack, run by the package on the survivors."""
    try:
        from pyautoattack import AutoAttack as ReferenceAutoAttack
    except ImportError as e:
        raise RuntimeError("engine='reference' needs the pyautoattack package (pip install pyautoattack==0.2.0)") from e
    import pyautoattack.checks
    from pyautoattack.autopgd_base import APGDAttack, APGDAttack_targeted

    # its APGD warns of zero gradients "See flags_doc.md", a file of the reference's repository
    pyautoattack.checks.checks_doc_path = f"robust-lightning's {reference_checks.DOCS}"

    model, norm, eps, seed, device = adversary.model, adversary.norm, adversary.eps, adversary.seed, adversary.device
    reference = ReferenceAutoAttack(model, norm=norm, eps=eps, version="standard", seed=seed, device=device)
    for name, build in (("apgd", APGDAttack), ("apgd_targeted", APGDAttack_targeted)):
        settings = getattr(adversary, name)
        if settings.n_iter != 100:  # rebuilt: the APGD checkpoint schedule is set in the constructor
            setattr(
                reference,
                name,
                build(
                    model,
                    n_iter=settings.n_iter,
                    eps=eps,
                    norm=norm,
                    seed=seed,
                    device=device,
                    use_largereps=norm == "L1",
                    verbose=False,
                ),
            )
        getattr(reference, name).n_restarts = settings.n_restarts
        getattr(reference, name).eot_iter = settings.eot_iter
    reference.apgd_targeted.n_target_classes = adversary.apgd_targeted.n_target_classes
    reference.fab.n_iter, reference.fab.n_target_classes = adversary.fab.n_iter, adversary.fab.n_target_classes
    reference.fab.n_restarts = adversary.fab.n_restarts  # untargeted FAB's; the reference runs FAB-T once
    reference.square.n_queries, reference.square.n_restarts = adversary.square.n_queries, adversary.square.n_restarts
    reference.attacks_to_run = [attack]
    x_adv: Tensor = reference.run_standard_evaluation(x.to(device), y.to(device), batch_size=bs)[0]
    return x_adv.to(x.device)


def zero_gradients(adversary: "AutoAttack", x: Tensor, y: Tensor) -> list[Check]:
    """The reference's zero_gradients check as the package computes it inside APGD: on the points the attack gets
    (``x``, those classified correctly), at APGD's random start, with the DLR loss of the first DLR attack (APGD-T:
    towards the highest other class); none where no DLR attack runs or no point is left. The model has more than
    3 classes."""
    dlr = [attack for attack in adversary.attacks if attack in ("apgd-t", "apgd-dlr")]
    if not dlr or not len(x):
        return []
    generator = torch.Generator(x.device).manual_seed(adversary.seed or 0)
    start = random_start_point(x, adversary.norm, adversary.eps, generator).clamp(0, 1)
    if dlr[0] == "apgd-t":
        with torch.no_grad():
            target = adversary.model(x).sort(dim=1)[1][:, -2]
        eot = adversary.apgd_targeted.eot_iter
        grad = input_gradient(adversary.model, start, y, "dlr-targeted", target, eot)[2]
    else:
        grad = input_gradient(adversary.model, start, y, "dlr", eot_iter=adversary.apgd.eot_iter)[2]
    return [reference_checks.zero_gradients(grad)]
