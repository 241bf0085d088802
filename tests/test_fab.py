"""Targeted FAB (robust_lightning.attacks.fab) against the reference (pyautoattack 0.2.0) and invariants.

The model is a tiny conv net trained for a few dozen steps on synthetic class prototypes (3x16x16, 10
classes), so that minimal adversarial norms spread around the chosen eps: part of the batch is broken,
part is robust. Three points get a wrong label to exercise the "misclassified on clean input" path.
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import device_path_reads_nothing
from robust_lightning.attacks import projections
from robust_lightning.attacks.fab import (
    FABResult,
    fab_targeted,
    project_hyperplane_l1,
    project_hyperplane_l2,
    project_hyperplane_linf,
)
from robust_lightning.attacks.projections import lp_norm

NORMS = ("Linf", "L2", "L1")
EPS = {"Linf": 6 / 255, "L2": 0.5, "L1": 4.0}  # about half of the correctly classified points break
N_MISLABELLED = 3


def _train_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prototypes = 0.35 + 0.3 * torch.rand(10, 3, 16, 16, generator=g)

    def sample(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return (prototypes[y] + 0.15 * torch.randn(n, 3, 16, 16, generator=g)).clamp(0, 1), y

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        x, y = sample(64)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    x, y = sample(32)
    y[:N_MISLABELLED] = (y[:N_MISLABELLED] + 1) % 10
    return model.eval(), x, y


@functools.cache
def setup():
    model, x, y = _train_model()
    with torch.no_grad():
        correct = model(x).argmax(1) == y
    assert correct.sum() == len(x) - N_MISLABELLED  # the model fits the (correctly labelled) test points
    return model, x, y


@functools.cache
def ours(norm: str, target_rank: int = 2, n_iter: int = 100) -> FABResult:
    model, x, y = setup()
    return fab_targeted(model, x, y, norm=norm, eps=EPS[norm], n_iter=n_iter, target_rank=target_rank)


def _reference(norm: str, n_iter: int = 100):
    from pyautoattack.fab_pt import FABAttack_PT

    model, _, _ = setup()
    # n_target_classes=1: perturb() runs the single target rank 2 (its loop is range(2, n_target_classes + 2)).
    # (Its backward also fills the parameters' .grad; harmless here, the gradient test uses a fresh model.)
    return FABAttack_PT(
        model,
        norm=norm,
        n_restarts=1,
        n_iter=n_iter,
        eps=EPS[norm],
        seed=0,
        targeted=True,
        n_target_classes=1,
        device="cpu",
    )


# --------------------------------------------------------------------------------- vs the reference


@pytest.mark.parametrize("norm", NORMS)
def test_matches_reference_perturb(norm):
    """Same per-point robust decisions and the same adversarial examples as AutoAttack's FAB-T (rank 2)."""
    pytest.importorskip("pyautoattack")
    model, x, y = setup()
    ref_adv = _reference(norm).perturb(x, y)
    with torch.no_grad():
        ref_robust = model(ref_adv).argmax(1) == y
    res = ours(norm)

    # Both take the same steps and agree to float rounding (the projections sum in other orders, and the
    # reference runs on the correctly classified points only, we on the whole batch): a point whose best norm
    # is within rounding of eps could flip, so allow one.
    assert (res.robust != ref_robust).sum() <= 1
    same = res.robust == ref_robust
    assert ((res.x_adv[same] - ref_adv[same]).abs() <= 1e-5).float().mean() > 0.99
    torch.testing.assert_close(
        lp_norm(res.x_adv - x, norm)[same], lp_norm(ref_adv - x, norm)[same], rtol=1e-4, atol=1e-5
    )
    # The batch is informative: some points broken by the attack, some robust, plus the mislabelled ones.
    n_broken = (~res.robust[N_MISLABELLED:]).sum()
    assert 5 <= n_broken <= len(x) - N_MISLABELLED - 5


@pytest.mark.parametrize("norm", NORMS)
def test_matches_reference_norms_other_rank(norm):
    """Rank 3 via the reference's attack_single_run, which returns the closest adversarial found even when it
    is farther than eps: the same points are broken at the same (minimal found) distances."""
    pytest.importorskip("pyautoattack")
    model, x, y = setup()
    ref = _reference(norm, n_iter=30)
    ref.target_class = 3
    ref_adv = ref.attack_single_run(x, y, use_rand_start=False, is_targeted=True)
    ref_norm = lp_norm(ref_adv - x, norm)
    ref_found = ref_norm > 0  # x itself is correctly classified, so a found adversarial is at distance > 0

    res = ours(norm, target_rank=3, n_iter=30)
    attacked = torch.arange(len(x)) >= N_MISLABELLED
    found = torch.isfinite(res.norm) & attacked
    assert torch.equal(found[attacked], ref_found[attacked])
    torch.testing.assert_close(res.norm[found], ref_norm[found], rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        ref_robust = (model(ref_adv).argmax(1) == y) | (ref_norm > EPS[norm])
    assert (res.robust[attacked] != ref_robust[attacked]).sum() <= 1


@pytest.mark.parametrize("prefix", [2, 32, 10**9])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 768])
def test_projections_match_reference(n, prefix, monkeypatch):
    """The vectorised projections equal the reference's, including unreachable hyperplanes, zero weights,
    coordinates at the box bounds and ties; whether the CPU sorts a few keys per row first and more for the
    rows that need them (prefix 2: most rows need more), or every key at once (as on GPUs)."""
    ref = pytest.importorskip("pyautoattack.fab_projections")
    monkeypatch.setattr(projections, "_PREFIX", prefix)
    g = torch.Generator().manual_seed(n)
    rows = 48
    t = torch.rand(rows, n, generator=g)
    t[:, : n // 4] = t[:, : n // 4].round()  # coordinates at 0 or 1 (ties in the sorts)
    w = torch.randn(rows, n, generator=g) * 10 * torch.rand(rows, 1, generator=g)
    w[torch.rand(rows, n, generator=g) < 0.2] = 0
    w[:2] = 0  # no direction at all
    w[2:4] *= 1e-9  # below the reference's 1e-8 threshold
    # Hyperplanes near and far (the far ones are out of the box's reach).
    b = (w * torch.rand(rows, n, generator=g)).sum(1) + torch.randn(rows, generator=g) * torch.arange(rows) / 4
    for mine, theirs in (
        (project_hyperplane_linf, ref.projection_linf),
        (project_hyperplane_l2, ref.projection_l2),
        (project_hyperplane_l1, ref.projection_l1),
    ):
        d = mine(t, w, b)
        torch.testing.assert_close(d, theirs(t.clone(), w.clone(), b.clone()), rtol=1e-5, atol=1e-6)
        # Whatever the case, the projected point stays in the box.
        assert ((t + d) >= -1e-6).all() and ((t + d) <= 1 + 1e-6).all()


@pytest.mark.parametrize("norm", NORMS)
def test_projection_reaches_hyperplane_with_minimal_norm(norm):
    """Independent check: where the hyperplane is reachable inside the box, t + d lies on it, and no
    feasible perturbation found by random search along the hyperplane has a smaller norm."""
    g = torch.Generator().manual_seed(0)
    rows, n = 64, 20
    t = 0.2 + 0.6 * torch.rand(rows, n, generator=g)
    w = torch.randn(rows, n, generator=g)
    b = (w * t).sum(1) + 0.3 * torch.randn(rows, generator=g)  # close: reachable
    project = {"Linf": project_hyperplane_linf, "L2": project_hyperplane_l2, "L1": project_hyperplane_l1}[norm]
    d = project(t, w, b)
    torch.testing.assert_close((w * (t + d)).sum(1), b, rtol=1e-4, atol=1e-4)
    # Random feasible points on the hyperplane: move along w's direction to hit it exactly.
    for _ in range(20):
        z = (t + 0.3 * torch.randn(rows, n, generator=g)).clamp(0, 1)
        z = z + ((b - (w * z).sum(1)) / (w * w).sum(1))[:, None] * w
        ok = ((z >= 0) & (z <= 1)).all(1)
        assert (lp_norm(d, norm)[ok] <= lp_norm(z - t, norm)[ok] + 1e-5).all()


# ---------------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("norm", NORMS)
def test_invariants(norm):
    model, x, y = setup()
    res = ours(norm)
    eps = EPS[norm]
    assert res.x_adv.shape == x.shape and res.x_adv.dtype == torch.float32
    assert res.robust.dtype == torch.bool and res.norm.dtype == torch.float32
    assert res.x_adv.min() >= 0 and res.x_adv.max() <= 1
    assert (lp_norm(res.x_adv - x, norm) <= eps + 1e-5).all()
    with torch.no_grad():
        pred = model(res.x_adv).argmax(1)
    assert (pred[~res.robust] != y[~res.robust]).all()  # non-robust points are misclassified at x_adv
    assert torch.equal(res.x_adv[res.robust], x[res.robust])  # robust points come back untouched
    # The mislabelled points are not attacked: not robust, x_adv = x, norm 0.
    assert not res.robust[:N_MISLABELLED].any()
    assert torch.equal(res.x_adv[:N_MISLABELLED], x[:N_MISLABELLED])
    assert (res.norm[:N_MISLABELLED] == 0).all()
    # Broken points: norm = distance of x_adv; robust points: no adversarial within eps.
    broken = ~res.robust
    broken[:N_MISLABELLED] = False
    torch.testing.assert_close(res.norm[broken], lp_norm(res.x_adv - x, norm)[broken])
    assert (res.norm[res.robust] > eps).all()


def test_no_parameter_gradients_and_forward_count():
    """Input gradients only (parameters' .grad stay None, also when called under no_grad), one forward with
    backward and one forward without per iteration, plus the final check (and the clean forward if needed)."""
    model, x, y = _train_model()  # fresh: the reference run above fills the shared model's .grad
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    calls = []

    def counting(inp):
        calls.append(torch.is_grad_enabled())
        return model(inp)

    with torch.no_grad():
        res = fab_targeted(counting, x, y, norm="L2", eps=EPS["L2"], n_iter=5)
    assert all(p.grad is None for p in model.parameters())
    assert len(calls) == 1 + 2 * 5 + 1 and sum(calls) == 5

    calls.clear()
    with torch.no_grad():
        logits = model(x)
    res2 = fab_targeted(counting, x, y, norm="L2", eps=EPS["L2"], n_iter=5, logits_clean=logits)
    assert len(calls) == 2 * 5 + 1
    assert torch.equal(res.x_adv, res2.x_adv) and torch.equal(res.robust, res2.robust)
    assert all(p.grad is None for p in model.parameters())


def test_target_rank_and_argument_checks():
    model, x, y = setup()
    # Different ranks attack different targets, hence different minimal norms.
    assert not torch.equal(ours("Linf", 2).norm, ours("Linf", 3).norm)
    with pytest.raises(ValueError, match="target_rank"):
        fab_targeted(model, x, y, eps=0.1, target_rank=11)
    with pytest.raises(ValueError, match="target_rank"):
        fab_targeted(model, x, y, eps=0.1, target_rank=1)
    with pytest.raises(ValueError, match="norm"):
        fab_targeted(model, x, y, norm="L0", eps=0.1)
    with pytest.raises(ValueError, match="int64"):
        fab_targeted(model, x, y.int(), eps=0.1)


@pytest.mark.parametrize("norm", NORMS)
def test_device_path_never_reads_back(norm, monkeypatch):
    """The path GPUs take (every key of the projections sorted at once) reads no value back to the host, in the
    set-up or any iteration (checked op by op on the CPU, so without a GPU), and gives the CPU path's result."""
    model, x, y = setup()
    with torch.no_grad():
        logits = model(x)
    kwargs = dict(norm=norm, eps=EPS[norm], n_iter=10, target_rank=torch.arange(len(x)) % 9 + 2, logits_clean=logits)
    # the recorder sees the CPU path's reads (whether a partial sort sufficed)
    assert device_path_reads_nothing(lambda: fab_targeted(model, x, y, **kwargs), monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to detect host-device synchronisation")
def test_no_synchronisation_on_cuda():
    model, x, y = setup()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    with torch.no_grad():
        logits = model(x)
    fab_targeted(model, x, y, eps=0.1, n_iter=2, logits_clean=logits)  # warm-up (lazy CUDA initialisation)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for norm in NORMS:
            res = fab_targeted(model, x, y, norm=norm, eps=EPS[norm], n_iter=10, logits_clean=logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert res.x_adv.is_cuda
