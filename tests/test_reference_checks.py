"""The reference AutoAttack's checks (robust_lightning.attacks.checks): each raised by a model of the kind it is
for, and by nothing else, with the verdict of pyautoattack's own check on the same input; and an AutoAttack run's
report carrying them (a plain model raises none, a randomized one raises ``randomized``)."""

import warnings

import pytest
import torch
from pyautoattack import checks as reference
from torch import nn

from robust_lightning.attacks import checks
from robust_lightning.attacks.apgd import input_gradient
from robust_lightning.attacks.ensemble import AutoAttack

NUM_CLASSES = 10


def plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, NUM_CLASSES)).eval()


class Randomized(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = plain()

    def forward(self, x):
        return self.net(x) + 0.5 * torch.randn(len(x), NUM_CLASSES)


class Probabilities(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = plain()

    def forward(self, x):
        return self.net(x).softmax(1)


class Quantized(nn.Module):
    """Input quantization: rounding has a zero gradient everywhere."""

    def __init__(self):
        super().__init__()
        self.net = plain()

    def forward(self, x):
        return self.net(torch.round(x * 4) / 4)


class OptimisesAtInference(nn.Module):
    """One gradient step on its input inside the forward pass (a dynamic defence)."""

    def __init__(self):
        super().__init__()
        self.net = plain()

    def forward(self, x):
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.net(x_).logsumexp(1).sum(), x_)
        return self.net((x - 0.01 * grad.sign()).clamp(0, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.rand(16, 3, 8, 8, generator=generator), torch.randint(0, NUM_CLASSES, (16,), generator=generator)


def reference_raises(check, *args) -> bool:
    """Whether pyautoattack's check warns (it warns where no logger is given)."""
    reference.funcs.update(dict.fromkeys(reference.funcs, 0))  # its call counts are never reset by itself
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(*args)
    return bool(caught)


def gradient(model) -> torch.Tensor:
    """The DLR loss's input gradient on the points as classified (those an attack gets: the loss is constant where
    the label is the third class)."""
    x, _ = batch()
    torch.manual_seed(3)  # a randomized model's labels and gradient from the same draw
    with torch.no_grad():
        y = model(x).argmax(1)
    torch.manual_seed(3)
    return input_gradient(model, x, y, "dlr")[2]


MODELS = {
    "plain": plain,
    "randomized": Randomized,
    "range_output": Probabilities,
    "zero_gradients": Quantized,
    "dynamic": OptimisesAtInference,
}


@pytest.mark.parametrize("kind", MODELS)
def test_each_model_check_is_raised_by_its_kind_alone_as_the_reference_decides(kind):
    x, y = batch()
    model = MODELS[kind]()
    torch.manual_seed(2)
    found = {
        "randomized": (checks.randomized(model, x, y), reference_raises(reference.check_randomized, model, x, y)),
        "range_output": (checks.range_output(model, x), reference_raises(reference.check_range_output, model, x)),
        "zero_gradients": (
            checks.zero_gradients(gradient(model)),
            reference_raises(reference.check_zero_gradients, gradient(model)),
        ),
        "dynamic": (checks.dynamic(model, x), reference_raises(reference.check_dynamic, model, x)),
    }
    for name, (check, reference_verdict) in found.items():
        assert check.name == name
        assert check.raised == reference_verdict == (name == kind), name
        assert bool(check.advice) == check.raised
    assert found["range_output"][0].figures["num_classes"] == NUM_CLASSES


@pytest.mark.parametrize(
    ("robust_after", "raised"),
    [
        ({"clean": 0.9, "apgd-ce": 0.5, "apgd-t": 0.45, "fab-t": 0.45, "square": 0.40}, True),
        ({"clean": 0.9, "apgd-ce": 0.5, "apgd-t": 0.45, "fab-t": 0.45, "square": 0.449}, False),
        ({"clean": 0.9, "square": 0.1}, False),  # Square alone: nothing to compare it with
        ({"clean": 0.9, "apgd-ce": 0.5}, False),
    ],
)
def test_square_sr_compares_square_with_the_other_attacks_as_the_reference(robust_after, raised):
    check = checks.square_sr(robust_after)
    assert check.raised == reference_raises(reference.check_square_sr, robust_after) == raised


@pytest.mark.parametrize(
    ("num_classes", "attacks", "targets", "raised"),
    [
        (10, ("apgd-ce", "apgd-t", "fab-t", "square"), 9, False),
        (10, ("apgd-ce", "apgd-t", "fab-t", "square"), 10, True),
        (3, ("apgd-ce", "apgd-t"), 2, True),
        (2, ("apgd-ce", "apgd-dlr"), 1, True),
        (2, ("apgd-ce", "square"), 1, False),
    ],
)
def test_n_classes_as_the_reference(num_classes, attacks, targets, raised):
    check = checks.n_classes(num_classes, attacks, targets, targets)
    assert check.raised == reference_raises(reference.check_n_classes, num_classes, attacks, targets, targets) == raised


def _run(model):
    """An AutoAttack run on points the model classifies correctly (labels: its predictions), so that APGD-T
    attacks each: its report, and the warnings of fra31's call on the same points."""
    x, _ = batch()
    with torch.no_grad():
        y = model(x).argmax(1)
    # n_queries: the budget of Square from scratch, which a raised check calls for (adaptive: auto)
    adversary = AutoAttack(model, norm="Linf", eps=8 / 255, version="apgd-t", verbose=False, n_iter=5, n_queries=20)
    report = adversary.evaluate(x, y, bs=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adversary.run_standard_evaluation(x, y, bs=16)
    return report, [str(w.message) for w in caught if "AutoAttack check" in str(w.message)]


def test_an_autoattack_report_carries_the_checks_and_the_reference_call_warns_of_a_raised_one():
    report, warned = _run(plain())
    summary = report.summary()["checks"]
    assert set(summary) == {"randomized", "range_output", "dynamic", "n_classes", "zero_gradients", "square_sr"}
    assert not any(check["raised"] for check in summary.values()) and not warned

    report, warned = _run(Quantized())
    raised = [name for name, check in report.summary()["checks"].items() if check["raised"]]
    assert raised == ["zero_gradients"] and len(warned) == 1 and "zero input gradient" in warned[0]
    assert not AutoAttack(plain(), version="apgd-t", checks=False).evaluate(*batch(), bs=16).checks


@pytest.mark.parametrize("kind", MODELS)
def test_robust_lightning_evaluate_records_the_checks_a_model_raises(kind, tmp_path):
    """Through the AutoAttack callback (robust_lightning.evaluate): results.json's checks of each threat model (the
    sanity checks off: tests/test_sanity_checks.py has them). A randomized model may also make the DLR loss
    constant at a point (its label third in one draw): only its own check is required of it."""
    import robust_lightning

    model = MODELS[kind]()
    x, _ = batch()
    torch.manual_seed(4)
    with torch.no_grad():
        y = model(x).argmax(1)

    def checks() -> dict:
        results = robust_lightning.evaluate(
            model,
            (x, y),
            threat_models=[{"norm": "Linf", "eps": 8 / 255}],
            version="apgd-t",
            options={"autoattack": {"n_iter": 2, "n_queries": 20, "sanity_points": 0}},
            out_dir=tmp_path,
            accelerator="cpu",
        )
        return results["autoattack"]["threat_models"]["Linf-8_255"]["checks"]

    found = checks()
    assert set(found) == {"randomized", "range_output", "dynamic", "n_classes", "zero_gradients", "square_sr"}
    raised = {name for name, check in found.items() if check["raised"]}
    if kind == "randomized":
        assert "randomized" in raised
    else:
        assert raised == (set() if kind == "plain" else {kind})
    assert all(bool(check["advice"]) == check["raised"] for check in found.values())
    # kept beside the outcomes: a resumed evaluation, with nothing left to attack, reports the same
    resumed = checks()
    model_checks = {name: check for name, check in found.items() if name != "square_sr"}
    assert {name: check for name, check in resumed.items() if name != "square_sr"} == model_checks
