"""Untargeted FAB ("fab") and AutoAttack's version "plus" that runs it, against the reference (pyautoattack 0.2.0),
and their invariants."""

import pytest
import torch

from helpers import device_path_reads_nothing, synthetic_points
from robust_lightning.attacks import lp_norm
from robust_lightning.attacks.ensemble import AutoAttack
from robust_lightning.attacks.fab import fab_untargeted

NORMS = ("Linf", "L2", "L1")
EPS = {"Linf": 10 / 255, "L2": 0.75, "L1": 9.0}
N_ITER = 30
MISLABELLED = 3


@pytest.fixture(scope="module")
def points():
    x, y = synthetic_points(40, seed=1)
    y[:MISLABELLED] = (y[:MISLABELLED] + 1) % 10  # misclassified without attack: not attacked
    return x, y


@pytest.mark.parametrize("norm", NORMS)
def test_one_run_matches_the_reference_and_keeps_the_invariants(trained, points, norm):
    fab_pt = pytest.importorskip("pyautoattack.fab_pt")
    x, y = points
    reference = fab_pt.FABAttack_PT(
        trained, norm=norm, n_restarts=1, n_iter=N_ITER, eps=EPS[norm], seed=0, targeted=False, device="cpu"
    )
    reference_adv = reference.perturb(x, y)
    with torch.no_grad():
        reference_robust = (trained(reference_adv).argmax(1) == y)[MISLABELLED:]
    result = fab_untargeted(trained, x, y, norm=norm, eps=EPS[norm], n_iter=N_ITER)
    robust = result.robust[MISLABELLED:]
    # the same steps up to float rounding (the projections sum in other orders): a point within rounding of eps
    # could flip, so one may differ
    assert (robust != reference_robust).sum() <= 1
    assert 5 <= (~robust).sum() <= len(robust) - 5  # some broken, some robust: the comparison says something
    same = torch.cat([torch.zeros(MISLABELLED, dtype=torch.bool), robust == reference_robust])
    torch.testing.assert_close(
        lp_norm(result.x_adv - x, norm)[same], lp_norm(reference_adv - x, norm)[same], rtol=1e-4, atol=1e-5
    )
    # invariants: in the box and the eps-ball, misclassified where broken, untouched where robust or not attacked
    assert result.x_adv.min() >= 0 and result.x_adv.max() <= 1
    assert (lp_norm(result.x_adv - x, norm) <= EPS[norm] + 1e-5).all()
    with torch.no_grad():
        predicted = trained(result.x_adv).argmax(1)
    assert (predicted[~result.robust] != y[~result.robust]).all()
    assert torch.equal(result.x_adv[result.robust], x[result.robust])
    assert not result.robust[:MISLABELLED].any() and torch.equal(result.x_adv[:MISLABELLED], x[:MISLABELLED])


@pytest.mark.parametrize("norm", NORMS)
def test_a_random_start_is_at_half_of_eps_and_drawn_from_the_generator(trained, points, norm):
    x, y = points
    seen = []

    def recording(inputs):
        seen.append(inputs)
        return trained(inputs)

    fab_untargeted(
        recording,
        x,
        y,
        norm=norm,
        eps=EPS[norm],
        n_iter=1,
        random_start=True,
        generator=torch.Generator().manual_seed(0),
    )
    start = seen[1]  # after the clean forward: the first step's forward is at the start
    distance = lp_norm(start - x, norm)
    assert (distance <= 0.5 * EPS[norm] + 1e-5).all() and (distance > 0).all()
    seen.clear()
    per_point = torch.arange(len(x)) % 2 == 0
    fab_untargeted(
        recording,
        x,
        y,
        norm=norm,
        eps=EPS[norm],
        n_iter=1,
        random_start=per_point,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(seen[1][~per_point], x[~per_point]) and (lp_norm(seen[1] - x, norm)[per_point] > 0).all()


def test_the_plus_version_is_the_references():
    autoattack = pytest.importorskip("pyautoattack")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    ours = AutoAttack(model, norm="Linf", version="plus")
    reference = autoattack.AutoAttack(model, norm="Linf", version="plus", device="cpu")
    assert list(ours.attacks) == reference.attacks_to_run
    assert (
        (ours.apgd.n_restarts, ours.fab.n_restarts) == (reference.apgd.n_restarts, reference.fab.n_restarts) == (5, 5)
    )
    assert ours.apgd_targeted.n_restarts == reference.apgd_targeted.n_restarts == 1
    assert ours.apgd_targeted.n_target_classes == reference.apgd_targeted.n_target_classes == 9
    assert ours.fab.n_target_classes == reference.fab.n_target_classes == 9
    assert ours.square.n_queries == reference.square.n_queries == 5000
    # "fab" in a custom list starts from the reference constructor's 5 restarts
    assert AutoAttack(model, version="custom", attacks=["fab"]).fab.n_restarts == reference.fab.n_restarts


def test_the_plus_version_matches_the_reference_engine(trained, points):
    pytest.importorskip("pyautoattack")
    x, y = points
    reports = {}
    for engine in ("fast", "reference"):
        adversary = AutoAttack(trained, norm="L2", eps=EPS["L2"], seed=0, version="plus", engine=engine, n_queries=100)
        for settings in (adversary.apgd, adversary.apgd_targeted, adversary.fab):
            settings.n_iter = 10
        adversary.apgd.n_restarts = adversary.fab.n_restarts = 2  # a random restart each, as in plus, fewer
        reports[engine] = adversary.evaluate(x, y, bs=40)
    fast, reference = reports["fast"], reports["reference"]
    assert fast.attacks == reference.attacks == ("apgd-ce", "apgd-dlr", "fab", "square", "apgd-t", "fab-t")
    assert torch.equal(fast.clean, reference.clean)
    assert 0.1 < reference.robust_accuracy < 0.85 * reference.clean_accuracy
    assert (fast.robust != reference.robust).sum() <= 2  # random starts and restarts draw differently
    assert fast.x_adv.min() >= 0 and fast.x_adv.max() <= 1
    assert (lp_norm(fast.x_adv - x, "L2") <= EPS["L2"] * (1 + 1e-5) + 1e-6).all()
    assert set(fast.refuted) == set(fast.attacks) and sum(fast.refuted.values()) == 0


@pytest.mark.parametrize("norm", NORMS)
def test_the_device_path_never_reads_back(trained, points, norm, monkeypatch):
    """As FAB-T (tests/test_fab.py): on the path GPUs take, no value is read back to the host, restarts' random
    starts included (checked op by op on the CPU)."""
    x, y = points
    with torch.no_grad():
        logits = trained(x)
    restarts = torch.arange(len(x)) % 2 == 1

    def attack():  # each path from the same draws
        generator = torch.Generator().manual_seed(0)
        return fab_untargeted(
            trained,
            x,
            y,
            norm=norm,
            eps=EPS[norm],
            n_iter=3,
            random_start=restarts,
            generator=generator,
            logits_clean=logits,
        )

    assert device_path_reads_nothing(attack, monkeypatch)
