"""AutoAttack's checks wired as the reference (pyautoattack 0.2.0) wires them, and Carlini et al.'s sanity checks
without false alarms: zero_gradients on every batch and at every DLR start, on the points still attacked; a model in
train mode attacked as given, with a warning; raised checks in log_path before the attacks; two classes run what
they allow instead of crashing; the sanity checks over the first sanity_points points across batches, their
agreement compared in counts, and a randomized model told about EoT."""

import warnings

import pytest
import torch
from torch import Tensor, nn

from attack_zoo import Noisy
from helpers import synthetic_points, train_small_cnn
from robust_lightning.attacks import AutoAttack, sanity

EPS = 8 / 255


@pytest.fixture(scope="module")
def net():
    return train_small_cnn()


class MaskedWhereMarked(nn.Module):
    """``net``, with its output cut from the input's gradient for the marked images (channel 0 all ones: its mean
    stays above 0.9 anywhere in the eps-ball)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        logits = self.net(x)
        marked = (x[:, 0].flatten(1).mean(1) > 0.9)[:, None]
        return torch.where(marked, logits.detach(), logits)


def labelled_by(model: nn.Module, x: Tensor) -> Tensor:
    """Every point correctly classified, so that every point is attacked."""
    with torch.no_grad():
        return model(x).argmax(1)


def marked_in_the_second_batch(net: nn.Module) -> tuple[nn.Module, Tensor, Tensor]:
    """16 points in two batches of 8, 6 of the second marked."""
    x, _ = synthetic_points(16, seed=7)
    x[9:15, 0] = 1.0
    model = MaskedWhereMarked(net).eval()
    return model, x, labelled_by(model, x)


def test_zero_gradients_is_raised_by_masked_points_in_the_second_batch_as_the_reference_raises_it(net):
    model, x, y = marked_in_the_second_batch(net)
    ours = AutoAttack(model, norm="Linf", eps=EPS, version="apgd-t", n_iter=5, verbose=False, adaptive="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ours.evaluate(x, y, bs=8)
    zero = {check.name: check for check in report.checks}["zero_gradients"]
    assert zero.raised and zero.figures["starts_with_zero_gradient"] > 0
    assert any("zero_gradients" in str(w.message) for w in caught)

    unmarked = AutoAttack(model, norm="Linf", eps=EPS, version="apgd-t", n_iter=5, verbose=False, adaptive="none")
    clean_x, _ = synthetic_points(16, seed=7)
    clean_report = unmarked.evaluate(clean_x, labelled_by(model, clean_x), bs=8)
    assert not {check.name: check for check in clean_report.checks}["zero_gradients"].raised

    reference = AutoAttack(model, norm="Linf", eps=EPS, version="apgd-t", n_iter=5, verbose=False, engine="reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference.evaluate(x, y, bs=8)
    assert any("zero" in str(w.message).lower() and "gradient" in str(w.message).lower() for w in caught)


def test_evaluate_records_zero_gradients_raised_in_a_later_batch_and_sanity_checks_across_batches(net, tmp_path):
    """robust_lightning.evaluate in batches of 8: the checks of the second batch reach results.json, and the sanity
    checks run on the first 12 points, read across the first two batches."""
    import robust_lightning

    model, x, y = marked_in_the_second_batch(net)
    results = robust_lightning.evaluate(
        model,
        (x, y),
        threat_models=[{"norm": "Linf", "eps": EPS}],
        version="apgd-t",
        options={"autoattack": {"sanity_points": 12}},
        adaptive="none",
        n_iter=5,
        batch_size=8,
        out_dir=tmp_path,
        accelerator="cpu",
    )
    checks = results["autoattack"]["threat_models"]["Linf-8_255"]["checks"]
    assert checks["zero_gradients"]["raised"]
    assert checks["engines_agree"]["figures"]["points"] == 12


class DropoutOnTheInput(nn.Module):
    """A defence whose randomness lives in train mode: dropout on the input of ``net``, which stays in eval mode."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.drop, self.net = nn.Dropout(0.3), net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.drop(x))

    def train(self, mode: bool = True) -> "DropoutOnTheInput":
        super().train(mode)
        self.net.eval()
        return self


def test_a_model_in_train_mode_is_attacked_as_given_with_its_checks_logged_before_the_attacks(net, tmp_path):
    model = DropoutOnTheInput(net).train()
    x, y = synthetic_points(16, seed=3)
    log = tmp_path / "autoattack.log"
    adversary = AutoAttack(model, norm="Linf", eps=EPS, version="apgd-ce", n_iter=5, log_path=log)
    with pytest.warns(UserWarning, match="train mode"):
        adversary.run_standard_evaluation(x, y, bs=16)  # the reference's call, whose verbose lines go to log_path
    assert model.training  # attacked as given, never switched
    lines = log.read_text().splitlines()
    warned = next(i for i, line in enumerate(lines) if "AutoAttack check randomized" in line)
    attacked = next(i for i, line in enumerate(lines) if line.startswith("apgd-ce -"))
    assert warned < attacked  # the reference's order: checks first, then the attacks


class FirstTwoClasses(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)[:, :2]


def test_two_classes_run_the_attacks_they_allow_with_the_n_classes_advice_before_them(net):
    model = FirstTwoClasses(net).eval()
    x, _ = synthetic_points(12, seed=4)
    y = labelled_by(model, x)
    adversary = AutoAttack(model, norm="Linf", eps=EPS, version="standard", n_iter=5, n_queries=20, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = adversary.evaluate(x, y, bs=12)
    messages = [str(w.message) for w in caught]
    assert {check.name for check in report.checks if check.raised} >= {"n_classes"}
    assert any("too few for apgd-t" in m for m in messages)
    assert report.seconds.keys() >= {"apgd-ce", "fab-t", "square"} and "apgd-t" not in report.seconds
    assert 0 <= report.robust_accuracy <= report.clean_accuracy


def test_agreement_of_nine_in_ten_is_compared_in_counts_not_float32_shares():
    assert torch.tensor(36 / 40, dtype=torch.float32).item() < 0.9  # the share that raised the check before
    assert not sanity.too_few_agree(36, 40) and sanity.too_few_agree(35, 40)


def test_a_randomized_model_that_splits_the_engines_is_told_about_eot_not_the_reference_engine(net):
    torch.manual_seed(0)
    model = Noisy(net, sigma=0.5).eval()
    x, y = synthetic_points(40, seed=6)
    found = {check.name: check for check in sanity.sanity_checks(model, x, y, "Linf", EPS, n_iter=5)}
    agree = found["engines_agree"]
    assert agree.raised and "EoT" in agree.advice and "engine='reference'" not in agree.advice
