"""Attacks: APGD (Linf, L2, L1; CE, DLR, targeted DLR), the L1 projection, FGSM(-RS) and PGD.

Where the reference (pyautoattack) has the same thing, the results are compared with it on a fixed tiny
network; the rest is checked against invariants and small independent re-implementations.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import HostReads, device_path_reads_nothing, force_device_path
from robust_lightning.attacks import (
    apgd,
    dlr_loss,
    dlr_targeted_loss,
    fgsm,
    l1_projection,
    lp_norm,
    per_sample_loss,
    pgd,
    projections,
    random_start_point,
)

EPS = {"Linf": 2 / 255, "L2": 0.5, "L1": 5.0}
NUM_CLASSES = 10


def make_model(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    """A tiny deterministic conv net on 3x16x16 inputs, 10 classes.

    The last layer is scaled up so that the untrained net is confident (logit gaps of a few units, like a
    trained one) rather than near-uniform, which would make every loss hover around log(10).
    """
    torch.manual_seed(seed)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1)]
    if batchnorm:
        layers.append(nn.BatchNorm2d(16))
    layers += [nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, NUM_CLASSES)]
    with torch.no_grad():
        layers[-1].weight.mul_(30.0)
    return nn.Sequential(*layers).eval()


def make_batch(model: nn.Module, n: int = 24, seed: int = 1):
    """Images in [0, 1]; labels = the model's predictions for the first half (so that attacks have correctly
    classified points to flip) and random labels for the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 16, 16, generator=g)
    with torch.no_grad():
        y = model(x).argmax(1)
    y[n // 2 :] = torch.randint(0, NUM_CLASSES, (n - n // 2,), generator=g)
    return x, y


class Recorder(nn.Module):
    """Wraps a model and keeps every batch it was called on, to re-evaluate all iterates of an attack."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        return self.model(x)


def assert_in_ball(x_adv, x, norm, eps):
    assert x_adv.dtype == torch.float32
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    # Relative slack for L1: its norm is a sum over all coordinates, accumulated in float32.
    assert (lp_norm(x_adv - x, norm) <= eps * (1 + 1e-5) + 1e-6).all()


def losses_of(model, x, y, loss="ce", y_target=None):
    with torch.no_grad():
        return per_sample_loss(model(x), y, loss, y_target)


# ------------------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_apgd_invariants(norm):
    model = make_model()
    x, y = make_batch(model)
    eps = EPS[norm]
    rec = Recorder(model)
    res = apgd(rec, x, y, norm=norm, eps=eps, n_iter=10, random_start=True, generator=3)

    # Every evaluated iterate (start included) and every returned point lies in the eps-ball and the box.
    assert len(rec.inputs) == 11
    for xi in rec.inputs + [res.x_best, res.x_adv]:
        assert_in_ball(xi, x, norm, eps)

    # The start is the reference's random point drawn with the same seed.
    start = random_start_point(x, norm, eps, torch.Generator().manual_seed(3)).clamp(0, 1)
    torch.testing.assert_close(rec.inputs[0], start)

    # The best loss is the maximum over all evaluated iterates, attained at x_best, hence >= the start's.
    all_losses = torch.stack([losses_of(model, xi, y) for xi in rec.inputs])
    torch.testing.assert_close(res.loss_best, all_losses.max(0).values)
    torch.testing.assert_close(res.loss_best, losses_of(model, res.x_best, y))
    assert (res.loss_best >= all_losses[0]).all()
    assert (res.loss_best > all_losses[0]).float().mean() > 0.5  # the attack actually climbs

    # robust = correctly classified at every iterate; x_adv = last misclassified iterate, else the start.
    with torch.no_grad():
        correct = torch.stack([model(xi).argmax(1) == y for xi in rec.inputs])
        adv_pred = model(res.x_adv).argmax(1)
    assert torch.equal(res.robust, correct.all(0))
    assert (adv_pred[~res.robust] != y[~res.robust]).all()
    assert torch.equal(res.x_adv[res.robust], start[res.robust])
    last_wrong = (~correct).float().cumsum(0).argmax(0)  # index of the last misclassified iterate
    expected_adv = torch.stack(rec.inputs)[last_wrong, torch.arange(len(x))]
    assert torch.equal(res.x_adv[~res.robust], expected_adv[~res.robust])
    assert (~res.robust).any() and res.robust.any()
    torch.testing.assert_close(res.logits_last, model(rec.inputs[-1]).detach())

    # Deterministic under a seed (int or generator), and the seed matters.
    seeded = torch.Generator().manual_seed(3)
    again = apgd(model, x, y, norm=norm, eps=eps, n_iter=10, random_start=True, generator=seeded)
    assert torch.equal(again.x_best, res.x_best) and torch.equal(again.x_adv, res.x_adv)
    other = apgd(model, x, y, norm=norm, eps=eps, n_iter=10, random_start=True, generator=4)
    assert not torch.equal(other.x_best, res.x_best)


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_apgd_exit_broken_settles_the_same_points_with_fewer_passes(norm, monkeypatch):
    """Rows of broken points leave the run after iterations 1, 2, 4, ... (one read back each time, none
    between): the same robust flags, in-ball misclassified x_adv, the staying rows' trajectories unchanged,
    fewer rows forwarded; with several rows per point, a point's rows leave together."""
    force_device_path(monkeypatch)  # where only the exits read back
    model = make_model()
    x, y = make_batch(model)
    kwargs = dict(norm=norm, eps=EPS[norm], n_iter=20, random_start=True, generator=0)
    full = apgd(model, x, y, **kwargs)
    rec = Recorder(model)
    with HostReads() as reads:
        early = apgd(rec, x, y, exit_broken=torch.arange(len(x)), **kwargs)
    assert len(reads.calls) == 5  # after iterations 1, 2, 4, 8 and 16
    assert torch.equal(early.robust, full.robust) and full.robust.any() and not full.robust.all()
    torch.testing.assert_close(early.x_best[full.robust], full.x_best[full.robust])
    torch.testing.assert_close(early.loss_best[full.robust], full.loss_best[full.robust])
    assert_in_ball(early.x_adv, x, norm, EPS[norm])
    with torch.no_grad():
        assert (model(early.x_adv[~early.robust]).argmax(1) != y[~early.robust]).all()
    assert sum(len(batch) for batch in rec.inputs) < 21 * len(x)
    assert len(rec.inputs[-1]) == int(full.robust.sum())

    # two target classes of each point in one batch (as AutoAttack batches them): the same points are broken,
    # and a row leaves unbroken when its point's other row broke it
    points = torch.arange(len(x)).repeat(2)
    with torch.no_grad():
        ranked = model(x).argsort(1)
    kwargs.update(eps=EPS[norm] / 2, loss="dlr-targeted", y_target=torch.cat([ranked[:, -2], ranked[:, 0]]))
    both = apgd(model, x[points], y[points], **kwargs).robust.view(2, -1)
    assert (both[0] != both[1]).any()  # points that one target breaks and the other does not
    rec = Recorder(model)
    result = apgd(rec, x[points], y[points], exit_broken=points, **kwargs)
    with torch.no_grad():  # every row called broken is broken, also where the row left because of the other
        assert (model(result.x_adv[~result.robust]).argmax(1) != y[points][~result.robust]).all()
    both_early = result.robust.view(2, -1)
    assert torch.equal(both_early.all(0), both.all(0))
    assert len(rec.inputs[-1]) == 2 * int(both.all(0).sum())  # only the rows of unbroken points went on
    # every point broken: all rows leave, and the results are still complete, in the caller's order
    kwargs.update(eps=EPS[norm] * 20, loss="ce", y_target=None)
    gone = apgd(model, x, y, exit_broken=torch.arange(len(x)), **kwargs)
    assert not gone.robust.any() and gone.logits_last.shape == (len(x), NUM_CLASSES)
    with torch.no_grad():
        assert (model(gone.x_adv).argmax(1) != y).all()
    with pytest.raises(ValueError, match="exit_broken"):
        apgd(model, x, y, exit_broken=torch.arange(len(x) - 1))


def test_apgd_no_random_start_starts_at_clean_point():
    model = make_model()
    x, y = make_batch(model)
    rec = Recorder(model)
    apgd(rec, x, y, n_iter=3)
    assert torch.equal(rec.inputs[0], x)


class ScriptedModel(nn.Module):
    """The conv net plus a constant per-call logit offset that makes chosen points misclassified at chosen
    calls (call 0 evaluates the start) and correctly classified otherwise."""

    def __init__(self, y, wrong_at):
        super().__init__()
        self.model, self.y, self.wrong_at, self.calls, self.inputs = make_model(), y, wrong_at, 0, []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        offset = 100.0 * F.one_hot(self.y, NUM_CLASSES).float()  # the true class wins ...
        wrong = self.wrong_at.get(self.calls, torch.zeros_like(self.y, dtype=torch.bool))
        offset = torch.where(wrong[:, None], -offset, offset)  # ... except for the chosen points
        self.calls += 1
        return self.model(x) + offset


def test_apgd_returns_last_misclassified_iterate():
    x, y = make_batch(make_model(), n=6)
    mask = lambda *i: torch.isin(torch.arange(6), torch.tensor(i))  # noqa: E731
    # Point 0: wrong at iterate 3 only; point 1: at 2 and 4; point 2: at the start only; the rest never.
    model = ScriptedModel(y, {2: mask(1), 3: mask(0), 4: mask(1), 0: mask(2)})
    res = apgd(model, x, y, n_iter=6)
    assert res.robust.tolist() == [False, False, False, True, True, True]
    expected = [model.inputs[3][0], model.inputs[4][1], x[2], x[3], x[4], x[5]]
    assert torch.equal(res.x_adv, torch.stack(expected))


# ------------------------------------------------------------------------------------ vs the reference


# The reference warns about points with a zero DLR gradient (e.g. already far from the boundary).
ignore_zero_grad_warning = pytest.mark.filterwarnings("ignore:there are .* points with zero gradient")


def _reference(model, x, y, norm, loss, n_iter, x_init=None, y_target=None):
    from pyautoattack.autopgd_base import APGDAttack, APGDAttack_targeted

    if loss == "dlr-targeted":
        ref = APGDAttack_targeted(model, n_iter=n_iter, norm=norm, eps=EPS[norm], device="cpu")
        ref.y_target = y_target
    else:
        ref = APGDAttack(model, n_iter=n_iter, norm=norm, eps=EPS[norm], loss=loss, device="cpu")
    ref.init_hyperparam(x)
    x_best, robust, loss_best, x_adv = ref.attack_single_run(x, y, x_init=x_init)
    return x_best, loss_best, x_adv, robust


def _assert_matches_reference(res, ref, pixel_atol=1e-5):
    x_best, loss_best, x_adv, robust = ref
    # The two implementations run the same float32 arithmetic, and agree bit for bit on this machine. The
    # tolerances leave room for a different op order (e.g. another torch build): a near-zero gradient
    # component whose sign flips moves one pixel by a whole step, hence a fraction of equal pixels.
    for mine, theirs in ((res.x_best, x_best), (res.x_adv, x_adv)):
        assert ((mine - theirs).abs() <= pixel_atol).float().mean() > 0.99
    torch.testing.assert_close(res.loss_best, loss_best, rtol=1e-4, atol=1e-4)
    assert (res.robust == robust).float().mean() > 0.95


@ignore_zero_grad_warning
@pytest.mark.parametrize(
    "norm,loss,n_iter",
    [
        ("Linf", "ce", 2),
        ("Linf", "ce", 20),
        ("Linf", "dlr", 20),
        ("L2", "ce", 2),
        ("L2", "ce", 20),
        ("L2", "dlr", 10),
        ("L1", "ce", 2),
        ("L1", "ce", 20),
        ("L1", "dlr", 10),
    ],
)
def test_apgd_matches_reference_from_clean_start(norm, loss, n_iter):
    pytest.importorskip("pyautoattack")
    model = make_model()
    x, y = make_batch(model)
    # The reference takes the start point through x_init; with x_init == x its L1 sparsity starts at 0
    # (one coordinate per step), and ours, given the same x_init, does the same.
    ref = _reference(model, x, y, norm, loss, n_iter, x_init=x.clone())
    res = apgd(model, x, y, norm=norm, eps=EPS[norm], n_iter=n_iter, loss=loss, x_init=x.clone())
    _assert_matches_reference(res, ref)


@ignore_zero_grad_warning
@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_apgd_matches_reference_with_random_start(norm):
    pytest.importorskip("pyautoattack")
    model = make_model()
    x, y = make_batch(model)
    # Both draw the start from the global CPU RNG with the same calls (generator=None).
    torch.manual_seed(5)
    ref = _reference(model, x, y, norm, "ce", 10)
    torch.manual_seed(5)
    res = apgd(model, x, y, norm=norm, eps=EPS[norm], n_iter=10, random_start=True)
    # L1: the reference projects the Gaussian start (|delta_i| up to ~4) with a float32 cumulative sum that
    # is off by ~1e-5 (ours is exact, see test_l1_projection_*), so the pixels agree to 1e-4 there.
    _assert_matches_reference(res, ref, pixel_atol=1e-4 if norm == "L1" else 1e-5)


@ignore_zero_grad_warning
@pytest.mark.parametrize("norm", ["Linf", "L1"])
def test_apgd_targeted_matches_reference(norm):
    pytest.importorskip("pyautoattack")
    model = make_model()
    x, y = make_batch(model)
    y_target = (y + 3) % NUM_CLASSES
    ref = _reference(model, x, y, norm, "dlr-targeted", 10, x_init=x.clone(), y_target=y_target)
    res = apgd(
        model, x, y, norm=norm, eps=EPS[norm], n_iter=10, loss="dlr-targeted", y_target=y_target, x_init=x.clone()
    )
    _assert_matches_reference(res, ref)


@ignore_zero_grad_warning
def test_apgd_l1_eps_schedule_via_x_init_matches_reference():
    """The AutoAttack L1 schedule (3 eps, 2 eps, eps, each stage starting from the previous x_best): every
    stage of apgd(x_init=...) equals the reference's attack_single_run from the same, sparse, start."""
    pytest.importorskip("pyautoattack")
    from pyautoattack.autopgd_base import APGDAttack

    model = make_model()
    x, y = make_batch(model)
    torch.manual_seed(7)
    # The reference's decr_eps_pgd adds its projection as a correction (x_init += ...), which leaves ~1e-8
    # residues where it zeroes coordinates, and its initial sparsity counts them. We feed both attacks the
    # same starts, so this tests the stage semantics rather than that float detail.
    x_init = x + l1_projection(x, torch.randn(x.shape), 15.0)
    for eps, n_iter in [(15.0, 6), (10.0, 6), (5.0, 8)]:
        x_init = x + l1_projection(x, x_init - x, eps)
        assert (x_init != x).float().mean() < 0.9  # a sparse start: the step sparsity follows it
        ref = APGDAttack(model, n_iter=n_iter, norm="L1", eps=eps, device="cpu")
        ref.init_hyperparam(x)
        ref_best, ref_robust, ref_loss, ref_adv = ref.attack_single_run(x, y, x_init=x_init.clone())
        res = apgd(model, x, y, norm="L1", eps=eps, n_iter=n_iter, x_init=x_init)
        assert_in_ball(res.x_best, x, "L1", eps)
        _assert_matches_reference(res, (ref_best, ref_loss, ref_adv, ref_robust))
        x_init = res.x_best


# -------------------------------------------------------------------------------------- L1 projection


def _slow_l1_projection(x, delta, eps):
    """Per-sample float64 bisection on the threshold of the KKT solution, written independently."""
    out = []
    for xi, di in zip(x.double().flatten(1), delta.double().flatten(1)):
        upper = torch.where(di > 0, 1 - xi, xi)  # box room in the direction of each coordinate

        def proj(lam, di=di, upper=upper):
            return torch.sign(di) * torch.minimum((di.abs() - lam).clamp(min=0), upper)

        lo, hi = 0.0, float(di.abs().max())
        if proj(0.0).abs().sum() > eps:
            for _ in range(100):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if proj(mid).abs().sum() > eps else (lo, mid)
        else:
            hi = 0.0
        out.append(proj(hi))
    return torch.stack(out).view(delta.shape)


@pytest.mark.parametrize("prefix", [2, 32, 10**9])  # kinks sorted first on the CPU (all of them on GPUs)
@pytest.mark.parametrize("scale,eps", [(0.02, 0.5), (0.05, 5.0), (0.3, 12.0), (1.0, 2.0), (0.001, 5.0)])
def test_l1_projection_is_exact(scale, eps, prefix, monkeypatch):
    monkeypatch.setattr(projections, "_PREFIX", prefix)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 8, 8, generator=g)
    x[:, 0, 0, :4] = torch.tensor([0.0, 1.0, 0.0, 1.0])  # points on the box's faces
    delta = scale * torch.randn(x.shape, generator=g)
    p = l1_projection(x, delta, eps)
    assert p.shape == delta.shape
    torch.testing.assert_close(p.double(), _slow_l1_projection(x, delta, eps), atol=1e-6, rtol=0)

    # Feasible, and the ball constraint is tight exactly when the box-clipped delta lies outside the ball.
    assert (x + p).min() >= 0 and (x + p).max() <= 1
    l1 = lp_norm(p, "L1")
    clipped_l1 = lp_norm((x + delta).clamp(0, 1) - x, "L1")
    assert (l1 <= eps * (1 + 1e-6)).all()
    torch.testing.assert_close(l1, torch.minimum(clipped_l1, torch.full_like(l1, eps)), rtol=1e-5, atol=1e-5)

    # Projection characterisation: <delta - p, q - p> <= 0 for every feasible q (here: random ones).
    for _ in range(5):
        q = l1_projection(x, torch.randn(x.shape, generator=g) * scale * 2, eps)
        inner = ((delta - p).double() * (q - p).double()).flatten(1).sum(1)
        assert (inner <= 1e-6).all()


def test_l1_projection_matches_reference():
    pyautoattack = pytest.importorskip("pyautoattack.autopgd_base")
    g = torch.Generator().manual_seed(1)
    for scale, eps in [(0.02, 0.5), (0.05, 5.0), (0.1, 12.0)]:
        x = torch.rand(8, 3, 16, 16, generator=g)
        delta = scale * torch.randn(x.shape, generator=g)
        # The reference returns the correction to add to delta; ours returns the projected delta.
        ref = delta + pyautoattack.L1_projection(x, delta, eps)
        torch.testing.assert_close(l1_projection(x, delta, eps), ref, atol=1e-5, rtol=0)


# --------------------------------------------------------------------- the 2-step training attack


def _paper_two_step(model, x, y_soft, eps):
    """Singh et al.'s training attack written out: APGD-CE, 2 steps, Linf, no random start, soft targets."""

    def loss_grad(z):
        z = z.clone().requires_grad_(True)
        loss = -(y_soft * F.log_softmax(model(z), 1)).sum(1)
        return loss.detach(), torch.autograd.grad(loss.sum(), z)[0]

    def proj(z):
        return torch.min(torch.max(z, x - eps), x + eps).clamp(0, 1)

    x0 = x.clamp(0, 1)
    l0, g0 = loss_grad(x0)
    x1 = proj(x0 + 2 * eps * g0.sign())  # first step: step size 2 eps, momentum weight a = 1
    l1, g1 = loss_grad(x1)
    z2 = proj(x1 + 2 * eps * g1.sign())  # the check after step 1 halves nothing (the soft CE is > 0)
    x2 = proj(x1 + 0.75 * (z2 - x1) + 0.25 * (x1 - x0))
    l2, _ = loss_grad(x2)
    best, loss_best = x0.clone(), l0.clone()
    for xi, li in ((x1, l1), (x2, l2)):
        better = li > loss_best
        best[better], loss_best[better] = xi[better], li[better]
    return best, loss_best, (x0, x1, x2)


def _mixed_soft_batch(x, y, lam=0.7, smoothing=0.1):
    """MixUp of the batch with its reversal, then label smoothing: (B, C) probability targets."""
    one_hot = F.one_hot(y, NUM_CLASSES).float()
    x_mix = lam * x + (1 - lam) * x.flip(0)
    y_mix = lam * one_hot + (1 - lam) * one_hot.flip(0)
    return x_mix, (1 - smoothing) * y_mix + smoothing / NUM_CLASSES


class WavyModel(nn.Module):
    """Logits linear in sin(freq * x): so non-concave at the scale of a 2 eps step that, from a fixed start,
    the best of {x0, x1, x2} is sometimes x0, sometimes x1 and sometimes x2."""

    def __init__(self, freq: float = 200.0):
        super().__init__()
        torch.manual_seed(0)
        self.freq = freq
        self.linear = nn.Linear(3 * 16 * 16, NUM_CLASSES)
        with torch.no_grad():
            self.linear.weight.mul_(5.0)

    def forward(self, x):
        return self.linear(torch.sin(self.freq * x).flatten(1))


@pytest.mark.parametrize("model_fn", [make_model, WavyModel])
def test_two_step_training_attack_equals_paper_update(model_fn):
    model = model_fn()
    x, y = make_batch(model, n=32)
    x_mix, y_soft = _mixed_soft_batch(x, y)
    eps = 4 / 255
    best, loss_best, iterates = _paper_two_step(model, x_mix, y_soft, eps)
    res = apgd(model, x_mix, y_soft, norm="Linf", eps=eps, n_iter=2, loss="ce")
    torch.testing.assert_close(res.x_best, best, atol=1e-6, rtol=0)
    torch.testing.assert_close(res.loss_best, loss_best, atol=1e-5, rtol=1e-5)
    if model_fn is WavyModel:  # the argmax over the three iterates is exercised in every branch
        picks = torch.stack([(best == xi).flatten(1).all(1) for xi in iterates])
        assert picks.any(1).all()


# ----------------------------------------------------------------------------------- soft targets


def test_soft_label_attack_on_mixed_batch():
    model = make_model()
    x, y = make_batch(model)
    x_mix, y_soft = _mixed_soft_batch(x, y, lam=0.6, smoothing=0.1)
    eps = 8 / 255
    res = apgd(model, x_mix, y_soft, norm="Linf", eps=eps, n_iter=10)
    assert_in_ball(res.x_best, x_mix, "Linf", eps)
    assert_in_ball(res.x_adv, x_mix, "Linf", eps)
    clean = losses_of(model, x_mix, y_soft)
    torch.testing.assert_close(res.loss_best, losses_of(model, res.x_best, y_soft))
    assert (res.loss_best > clean).all()  # an untrained net: the soft CE stays near log(10), but rises
    # Correctness for soft targets is argmax(logits) == argmax(targets).
    with torch.no_grad():
        clean_correct = model(x_mix).argmax(1) == y_soft.argmax(1)
    assert not (res.robust & ~clean_correct).any()

    # Hard labels and their one-hot targets give the same attack.
    hard = apgd(model, x, y, n_iter=10)
    soft = apgd(model, x, F.one_hot(y, NUM_CLASSES).float(), n_iter=10)
    torch.testing.assert_close(soft.x_best, hard.x_best, atol=1e-6, rtol=0)
    torch.testing.assert_close(soft.loss_best, hard.loss_best)
    assert torch.equal(soft.robust, hard.robust)


# ------------------------------------------------------------------------------------------- DLR


def test_dlr_losses_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, NUM_CLASSES, generator=g) * 3
    y = torch.randint(0, NUM_CLASSES, (16,), generator=g)
    y[:4] = logits[:4].argmax(1)  # correctly classified points use the runner-up as the competitor
    y_target = (y + 1 + torch.randint(0, NUM_CLASSES - 1, (16,), generator=g)) % NUM_CLASSES
    expected, expected_t = [], []
    for z, label, target in zip(logits.tolist(), y.tolist(), y_target.tolist()):
        s = sorted(z, reverse=True)
        best_other = max(v for i, v in enumerate(z) if i != label)
        expected.append(-(z[label] - best_other) / (s[0] - s[2] + 1e-12))
        expected_t.append(-(z[label] - z[target]) / (s[0] - (s[2] + s[3]) / 2 + 1e-12))
    torch.testing.assert_close(dlr_loss(logits, y), torch.tensor(expected))
    torch.testing.assert_close(dlr_targeted_loss(logits, y, y_target), torch.tensor(expected_t))
    torch.testing.assert_close(per_sample_loss(logits.bfloat16(), y, "dlr"), dlr_loss(logits.bfloat16().float(), y))
    assert per_sample_loss(logits.bfloat16(), y, "dlr").dtype == torch.float32

    ref = pytest.importorskip("pyautoattack.autopgd_base")
    attack = ref.APGDAttack_targeted(lambda v: v, eps=1.0)
    attack.y_target = y_target
    torch.testing.assert_close(dlr_loss(logits, y), attack.dlr_loss(logits, y))
    torch.testing.assert_close(dlr_targeted_loss(logits, y, y_target), attack.dlr_loss_targeted(logits, y))


def test_targeted_attack_moves_towards_target():
    model = make_model()
    x, y = make_batch(model)
    y_target = (y + 5) % NUM_CLASSES
    res = apgd(model, x, y, eps=8 / 255, n_iter=20, loss="dlr-targeted", y_target=y_target)
    assert_in_ball(res.x_best, x, "Linf", 8 / 255)
    with torch.no_grad():
        before, after = model(x), model(res.x_best)
    margin = lambda z: z.gather(1, y_target[:, None]) - z.gather(1, y[:, None])  # noqa: E731
    # The loss is a ratio, which can also grow through its denominator: the margin of the target over the
    # true class grows for most points, not necessarily all.
    assert (res.loss_best > losses_of(model, x, y, "dlr-targeted", y_target)).all()
    assert (margin(after) > margin(before)).float().mean() > 0.8
    assert (after.argmax(1) == y_target).float().mean() > (before.argmax(1) == y_target).float().mean() + 0.1


# ------------------------------------------------------------------------------- precision, mode


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_apgd_under_bf16_autocast(norm):
    model = make_model()
    x, y = make_batch(model)
    eps = EPS[norm]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = apgd(model, x, y, norm=norm, eps=eps, n_iter=5)
        clean = per_sample_loss(model(x), y)
    for t in (res.x_best, res.x_adv, res.loss_best, res.logits_last):
        assert t.dtype == torch.float32
    assert_in_ball(res.x_best, x, norm, eps)
    assert_in_ball(res.x_adv, x, norm, eps)
    assert res.robust.dtype == torch.bool
    assert (res.loss_best >= clean).all() and res.loss_best.mean() > clean.mean()


@pytest.mark.parametrize("training", [True, False])
def test_attacks_leave_parameters_and_mode_alone(training):
    model = make_model(batchnorm=True).train(training)
    x, y = make_batch(model)
    with torch.no_grad():  # as in a validation step: the attacks enable gradients themselves
        apgd(model, x, y, n_iter=3)
        apgd(model, x, y, norm="L1", eps=5.0, n_iter=3)
        fgsm(model, x, y, eps=4 / 255, random_start=True, generator=0)
        pgd(model, x, y, eps=4 / 255, n_iter=2, generator=0)
    assert all(p.grad is None for p in model.parameters())
    assert all(m.training == training for m in model.modules())

    # Gradients already accumulated by the training step are neither changed nor added to.
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    apgd(model, x, y, n_iter=2)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("eot_iter, n_iter, asks", [(1, 30, [10, 20]), (5, 7, [2, 4, 6]), (20, 4, [1, 2, 3])])
def test_apgd_asks_its_stop_point_every_10_gradient_passes(eot_iter, n_iter, asks):
    """Every 10 iterations of a plain run, and every iteration of EoT's 20 passes per iterate: a stop does not wait
    for 200 gradient passes of a randomized model. The ask raises to stop, so the run ends there."""
    model = make_model()
    x, y = make_batch(model, n=4)
    calls, asked = [], []  # a mark per forward pass; the passes made at each ask
    counted = lambda inputs: calls.append(1) or model(inputs)  # noqa: E731

    def stop_point() -> None:
        asked.append(len(calls))

    apgd(counted, x, y, norm="Linf", eps=EPS["Linf"], n_iter=n_iter, eot_iter=eot_iter, stop_point=stop_point)
    # each iteration before the ask is eot_iter gradient passes, after the start's eot_iter
    assert asked == [eot_iter * (1 + i) for i in asks]

    class Stopped(Exception):
        pass

    def stop_at_first_ask() -> None:
        raise Stopped

    with pytest.raises(Stopped):
        apgd(model, x, y, norm="Linf", eps=EPS["Linf"], n_iter=n_iter, eot_iter=eot_iter, stop_point=stop_at_first_ask)


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_apgd_device_path_never_reads_back(norm, monkeypatch):
    """The path GPUs take reads no value back to the host, in the set-up or any iteration (checked op by op on
    the CPU, so without a GPU), and gives the CPU path's result."""
    model = make_model()
    x, y = make_batch(model)
    kwargs = dict(norm=norm, eps=EPS[norm], n_iter=10, random_start=True, generator=0)
    cpu_reads = device_path_reads_nothing(lambda: apgd(model, x, y, **kwargs), monkeypatch)
    assert bool(cpu_reads) == (norm == "L1")  # the recorder sees the CPU path's reads (L1's partial sorts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to detect host-device synchronisation")
def test_apgd_does_not_synchronise_on_cuda():
    model = make_model()
    x, y = make_batch(model)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    apgd(model, x, y, n_iter=4)  # warm-up (lazy CUDA initialisation may synchronise)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for norm in ("Linf", "L2", "L1"):
            apgd(model, x, y, norm=norm, eps=EPS[norm], n_iter=10, random_start=True, generator=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------------- FGSM and PGD


def test_fgsm_closed_form_and_random_start():
    model = make_model()
    x, y = make_batch(model)
    eps = 4 / 255
    x_req = x.clone().requires_grad_(True)
    grad = torch.autograd.grad(F.cross_entropy(model(x_req), y, reduction="sum"), x_req)[0]
    torch.testing.assert_close(fgsm(model, x, y, eps=eps), (x + eps * grad.sign()).clamp(0, 1))

    # FGSM-RS: uniform start in the ball, a 1.25 eps step, projection back onto the ball.
    x_rs = fgsm(model, x, y, eps=eps, random_start=True, generator=0)
    assert_in_ball(x_rs, x, "Linf", eps)
    assert torch.equal(x_rs, fgsm(model, x, y, eps=eps, random_start=True, generator=0))
    assert not torch.equal(x_rs, fgsm(model, x, y, eps=eps, random_start=True, generator=1))
    delta = (x_rs - x).abs()
    interior = (x > 2 * eps) & (x < 1 - 2 * eps)
    # From a uniform start in [-eps, eps], a 1.25 eps step ends on the ball's boundary in 5/8 of the
    # (unclipped) coordinates; a step of eps would in 1/2.
    on_boundary = ((delta[interior] - eps).abs() < 1e-6).float().mean()
    assert 0.6 < on_boundary < 0.65
    assert losses_of(model, x_rs, y).mean() > losses_of(model, x, y).mean()

    # Soft targets work too (CE with probabilities).
    _, y_soft = _mixed_soft_batch(x, y)
    assert_in_ball(fgsm(model, x, y_soft, eps=eps), x, "Linf", eps)


@pytest.mark.parametrize("norm", ["Linf", "L2"])
def test_pgd(norm):
    model = make_model()
    x, y = make_batch(model)
    eps = EPS[norm]
    x_adv = pgd(model, x, y, norm=norm, eps=eps, n_iter=10, generator=0)
    assert_in_ball(x_adv, x, norm, eps)
    clean, adv = losses_of(model, x, y), losses_of(model, x_adv, y)
    assert (adv > clean).float().mean() > 0.9 and adv.mean() > clean.mean() + 0.1
    assert torch.equal(x_adv, pgd(model, x, y, norm=norm, eps=eps, n_iter=10, generator=0))
    # Without random start, one step of size eps is exactly FGSM (Linf).
    if norm == "Linf":
        one = pgd(model, x, y, eps=eps, n_iter=1, step_size=eps, random_start=False)
        torch.testing.assert_close(one, fgsm(model, x, y, eps=eps))
    # The DLR loss is also an option; it increases too.
    x_dlr = pgd(model, x, y, norm=norm, eps=eps, n_iter=10, loss="dlr", generator=0)
    assert losses_of(model, x_dlr, y, "dlr").mean() > losses_of(model, x, y, "dlr").mean()


# ----------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"norm": "L3"}, "unknown norm"),
        ({"loss": "hinge"}, "unknown loss"),
        ({"eps": 0.0}, "eps must be > 0"),
        ({"n_iter": 0}, "n_iter must be"),
        ({"loss": "dlr-targeted"}, "needs y_target"),
        ({"random_start": True, "x_init": torch.zeros(2, 3, 16, 16)}, "either random_start"),
    ],
)
def test_apgd_rejects_bad_arguments(kwargs, match):
    model = make_model()
    x, y = torch.rand(2, 3, 16, 16), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=match):
        apgd(model, x, y, **kwargs)


def test_dlr_needs_hard_labels():
    model = make_model()
    x, y_soft = torch.rand(2, 3, 16, 16), torch.full((2, NUM_CLASSES), 0.1)
    with pytest.raises(ValueError, match="hard int64 labels"):
        apgd(model, x, y_soft, loss="dlr")
    with pytest.raises(ValueError, match="L1"):
        pgd(model, x, y_soft, norm="L1", eps=1.0)
