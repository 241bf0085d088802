"""The automated sanity checks of Carlini et al. (robust_lightning.attacks.sanity) on models whose gradients are
masked in known ways: a linear model whose input gradient is reversed (the attack ascends the wrong way) beyond a
given Linf distance from its clean points. Reversed everywhere but at the clean points, one gradient step breaks
what the iterative attack (random start) cannot; reversed beyond 1.5 eps, the robust accuracy rises with the
radius; reversed everywhere, an unbounded attack leaves points robust. Not reversed, nothing is raised."""

import pytest
import torch
from torch import nn

from robust_lightning.attacks import sanity

EPS = 16 / 255
SANITY = {"eps_monotonic", "unbounded", "iterative_vs_one_step", "engines_agree"}


class ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class ReversedBeyond(nn.Module):
    """A linear classifier whose input gradient is reversed where the input is further than ``radius`` (Linf)
    from every clean point ``x0``; its outputs are the linear model's everywhere."""

    def __init__(self, x0: torch.Tensor, radius: float):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(x0[0].numel(), 10))
        self.register_buffer("x0", x0)
        self.radius = radius

    def forward(self, x):
        distance = (x[:, None] - self.x0[None]).flatten(2).abs().amax(2).min(1).values
        far = (distance > self.radius).float()[:, None]
        logits = self.net(x)
        return logits * (1 - far) + ReverseGradient.apply(logits) * far


def points() -> torch.Tensor:
    return torch.rand(32, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def checks_of(radius: float) -> dict[str, sanity.Check]:
    x = points()
    model = ReversedBeyond(x, radius).eval()
    with torch.no_grad():
        y = model(x).argmax(1)  # every point correct: the attacks have work to do
    return {check.name: check for check in sanity.sanity_checks(model, x, y, "Linf", EPS, n_iter=10)}


@pytest.mark.parametrize(
    ("radius", "raised"),
    [
        (float("inf"), set()),
        (-1.0, {"unbounded"}),
        (1.5 * EPS, {"eps_monotonic"}),
        (0.0, {"unbounded", "iterative_vs_one_step"}),
    ],
)
def test_each_sanity_check_is_raised_by_the_masking_it_is_for(radius, raised):
    found = checks_of(radius)
    assert set(found) == {"eps_monotonic", "unbounded", "iterative_vs_one_step", "engines_agree"}
    assert {name for name, check in found.items() if check.raised} >= raised
    if not raised:
        assert not any(check.raised for check in found.values())
        figures = found["eps_monotonic"].figures
        assert list(figures) == [f"robust_accuracy_at_{m:g}x_eps" for m in sanity.EPS_MULTIPLIERS]
        assert found["unbounded"].figures["robust_accuracy"] == 0.0
        assert found["engines_agree"].figures["agreeing"] * 10 >= 9 * found["engines_agree"].figures["points"]
    for check in found.values():
        assert bool(check.advice) == check.raised


def test_unbounded_radii_reach_mid_grey_from_any_image():
    x = torch.zeros(1, 3, 4, 4)
    assert sanity.unbounded_eps("Linf", x) == 0.5
    assert sanity.unbounded_eps("L2", x) == pytest.approx(0.5 * 48**0.5)  # the distance from black to mid-grey
    assert sanity.unbounded_eps("L1", x) == 24.0


def test_the_autoattack_evaluation_records_the_sanity_checks_beside_the_references(tmp_path):
    """robust_lightning.evaluate (the AutoAttack callback) on the linear model: the sanity checks on the first
    batch, with their figures, none raised; reversed gradients everywhere: unbounded raised. (Not the adaptive
    attacks that a raised check calls for: tests/test_adaptive_attacks.py runs them.)"""
    import robust_lightning

    x = points()
    for radius, raised in ((float("inf"), set()), (-1.0, {"unbounded"})):
        model = ReversedBeyond(x, radius).eval()
        with torch.no_grad():
            y = model(x).argmax(1)
        results = robust_lightning.evaluate(
            model,
            (x, y),
            threat_models=[{"norm": "Linf", "eps": EPS}],
            version="apgd-ce",
            options={"autoattack": {"n_iter": 5, "sanity_points": 16, "adaptive": "none"}},
            out_dir=tmp_path / str(radius),
            accelerator="cpu",
        )
        section = results["autoattack"]["threat_models"]["Linf-16_255"]
        found = {name: check for name, check in section["checks"].items() if name in SANITY}
        assert set(found) == SANITY and found["engines_agree"]["figures"]["points"] == 16
        assert {name for name, check in found.items() if check["raised"]} >= raised
        if not raised:
            assert not any(check["raised"] for check in found.values())
        assert "sanity_checks" in section["seconds_this_session"]
