"""AutoAttack's version "rand" for randomized defences (Croce & Hein 2020, fra31/auto-attack): APGD-CE and APGD-DLR,
one restart, every iterate's gradient averaged over 20 forward/backward passes (Expectation over Transformation).
Tested against the reference (pyautoattack) on a deterministic model, and on a randomized one, where it must find
what the standard version misses."""

import math

import pytest
import torch
import torch.nn as nn

from helpers import run_test, synthetic_points
from robust_lightning.attacks import apgd, input_gradient, lp_norm
from robust_lightning.attacks.ensemble import AutoAttack

EPS = 10 / 255
ITERATIONS = 20  # the versions' 100 cut to 20 for the suite's time; the same for every engine and version


@pytest.fixture(scope="module")
def points():
    return synthetic_points(48, seed=1)


class PhaseNoise(nn.Module):
    """``base`` plus, per class, a sum over pixels of sinusoids whose phases are drawn afresh at every call: the
    logits move by about 0.01, but the input gradient gets noise several times larger than the base model's on
    every pixel. A single pass's gradient sign agrees with the base model's on 70 % of the pixels; the mean of 20
    passes recovers it. A stand-in for a randomized defence whose gradient only its expectation reveals."""

    def __init__(self, base: nn.Module, amplitude: float = 0.01, frequency: float = 2000.0):
        super().__init__()
        self.base, self.amplitude, self.frequency = base, amplitude, frequency
        weights = torch.randn(10, 3 * 16 * 16, generator=torch.Generator().manual_seed(123))
        self.register_buffer("weights", weights / math.sqrt(weights.shape[1]))
        self.draws = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pixels = x.flatten(1)
        phases = torch.rand(pixels.shape, generator=self.draws) * 2 * math.pi
        return self.base(x) + self.amplitude * torch.sin(self.frequency * pixels + phases) @ self.weights.T


def adversary(model, version: str, engine: str = "fast") -> AutoAttack:
    """The version's attacks alone: not EoT, which the standard version's randomness check calls for on PhaseNoise
    (tests/test_adaptive_attacks.py runs it)."""
    attack = AutoAttack(
        model, norm="Linf", eps=EPS, seed=0, version=version, engine=engine, n_queries=100, adaptive="none"
    )
    for settings in (attack.apgd, attack.apgd_targeted, attack.fab):
        settings.n_iter = ITERATIONS
    return attack


def test_the_rand_version_is_the_references():
    attack = AutoAttack(nn.Linear(4, 3), version="rand")
    assert attack.attacks == ("apgd-ce", "apgd-dlr")
    assert (attack.apgd.n_restarts, attack.apgd.eot_iter) == (1, 20)
    assert attack.apgd_targeted.eot_iter == 1  # EoT is the rand version's, not the standard one's
    assert AutoAttack(nn.Linear(4, 3), norm="L1", eps=9.0, version="rand").apgd.n_restarts == 1


def test_eot_averages_the_input_gradient_over_the_passes(trained, points):
    x, y = points[0][:8], points[1][:8]
    model = PhaseNoise(trained).eval()
    logits, losses, grad = input_gradient(model, x, y, "ce", eot_iter=4)
    replay = PhaseNoise(trained).eval()  # the same draws, one pass at a time
    passes = [input_gradient(replay, x, y, "ce") for _ in range(4)]
    torch.testing.assert_close(grad, sum(p[2] for p in passes) / 4)
    torch.testing.assert_close(logits, passes[-1][0])  # the last pass's, as the reference's APGD
    torch.testing.assert_close(losses, passes[-1][1])
    with pytest.raises(ValueError, match="eot_iter"):
        apgd(model, x, y, eot_iter=0)


def test_on_a_deterministic_model_the_fast_engine_matches_the_reference(trained, points):
    pytest.importorskip("pyautoattack")
    x, y = points
    fast = adversary(trained, "rand").evaluate(x, y, bs=48)
    reference = adversary(trained, "rand", engine="reference").evaluate(x, y, bs=48)
    assert fast.attacks == reference.attacks == ("apgd-ce", "apgd-dlr")
    assert torch.equal(fast.clean, reference.clean)
    assert 0.15 < reference.robust_accuracy < 0.85 * reference.clean_accuracy  # the comparison says something
    assert (fast.robust != reference.robust).sum() <= 2  # seed effects (random starts): at most 2 of 48
    assert fast.x_adv.min() >= 0 and fast.x_adv.max() <= 1
    assert (lp_norm(fast.x_adv - x, "Linf") <= EPS * (1 + 1e-5) + 1e-6).all()
    with torch.no_grad():
        assert (trained(fast.x_adv[~fast.robust]).argmax(1) != y[~fast.robust]).all()
    # the randomness check is the standard version's only, as in the reference
    assert "randomized" not in {check.name for check in fast.checks}
    assert "randomized" in {check.name for check in adversary(trained, "standard").evaluate(x, y, bs=48).checks}


def test_on_a_randomized_model_rand_finds_what_the_standard_version_misses(trained, points):
    x, y = points
    deterministic = adversary(trained, "standard").evaluate(x, y, bs=48).robust_accuracy
    standard = adversary(PhaseNoise(trained).eval(), "standard").evaluate(x, y, bs=48)
    rand = adversary(PhaseNoise(trained).eval(), "rand").evaluate(x, y, bs=48)
    # the noisy gradient misleads the standard version's attacks; averaged over 20 passes it is the base model's
    assert standard.robust_accuracy > rand.robust_accuracy + 0.1
    assert abs(rand.robust_accuracy - deterministic) <= 2 / 48
    assert rand.x_adv.min() >= 0 and rand.x_adv.max() <= 1
    assert (lp_norm(rand.x_adv - x, "Linf") <= EPS * (1 + 1e-5) + 1e-6).all()
    # and the standard version's randomness check says why its figure cannot be trusted
    randomized = next(check for check in standard.checks if check.name == "randomized")
    assert randomized.raised


def test_the_evaluation_callback_runs_the_rand_version(tmp_path, autoattack_checkpoint):
    results = run_test(tmp_path, autoattack_checkpoint, version="rand")  # `test` with the callback, n_iter 5
    assert results["conditions"]["version"] == "rand"
    assert results["conditions"]["attacks"] == ["apgd-ce", "apgd-dlr"]
    linf = results["threat_models"]["Linf-4_255"]
    assert list(linf["robust_accuracy_after"]) == ["apgd-ce", "apgd-dlr"]
    assert linf["robust_accuracy"] == linf["robust_accuracy_after"]["apgd-dlr"] <= linf["clean_accuracy"]
    assert "randomized" not in linf["checks"] and "zero_gradients" in linf["checks"]
