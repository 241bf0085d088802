"""Square Attack (Linf, L2, L1) against the reference ``pyautoattack.square.SquareAttack``.

Two kinds of comparison: (1) with the reference's random draws replayed (windows, signs and eta orientations
shared across the batch, as the reference draws them), both implementations must follow the same
trajectories (all of them for Linf and L2; most for L1, whose update amplifies round-off); (2) with independent
random streams (ours draws per point), robust accuracy and queries to break must agree statistically. Then
invariants, determinism, and the path GPUs take (forced on the CPU: the same results, logarithmically few reads
back). Everything runs on CPU on a tiny conv net trained briefly on synthetic data.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyautoattack import square as reference_square
from pyautoattack.autopgd_base import L1_projection
from pyautoattack.square import SquareAttack

from helpers import HostReads, force_device_path
from robust_lightning.attacks import square as square_module
from robust_lightning.attacks.projections import l1_projection, lp_norm
from robust_lightning.attacks.square import (
    SquareResult,
    _corner,
    _eta_pair,
    _p_selection,
    _square_side,
    _StepDraws,
    square_attack,
)

NUM_CLASSES = 10
# Radii at which about half of the correctly classified points break within a few hundred queries.
EPS = {"Linf": 4 / 255, "L2": 0.5, "L1": 4.0}


def _synthetic(n: int, templates: torch.Tensor, g: torch.Generator):
    """Noisy copies of low-contrast, smooth class templates: learnable, but with small margins."""
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    x = templates[y] + 0.3 * torch.randn(n, 3, 16, 16, generator=g)
    return x.clamp(0.0, 1.0), y


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """The attacks run many small ops (e.g. the L1 projection's sorts and sums) on tiny tensors: a second
    intra-op thread buys nothing and, on a busy 2-core machine, makes every op wait for it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(single_thread):
    """(model, x, y): a small conv net trained for a few steps, and 128 held-out points."""
    g = torch.Generator().manual_seed(0)
    templates = F.interpolate(torch.rand(NUM_CLASSES, 3, 4, 4, generator=g), size=16, mode="bilinear") * 0.2 + 0.4
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, NUM_CLASSES),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        x, y = _synthetic(128, templates, g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval().requires_grad_(False)
    x, y = _synthetic(128, templates, g)
    return model, x, y


def _correct(model, x, y):
    with torch.no_grad():
        return model(x).argmax(1) == y


# ------------------------------------------------------------------------------ building blocks


@pytest.mark.parametrize("norm", ["L2", "L1"])
def test_eta_matches_reference(norm):
    ref = SquareAttack(None, norm=norm, eps=1.0, device="cpu")
    for s in range(1, 25):
        expected = ref.eta(s)  # randomly transposed: ours holds both orientations
        ours = _eta_pair(s, norm, torch.float32, torch.device("cpu"))
        assert min((ours[0] - expected).abs().max(), (ours[1] - expected).abs().max()) < 1e-6, s


def test_p_schedule_matches_reference():
    ref = SquareAttack(None, p_init=0.8, resc_schedule=False)  # AutoAttack's setting
    assert all(_p_selection(i, 0.8) == ref.p_selection(i) for i in range(10_000))


def test_l1_projection_matches_reference():
    """The projection the L1 attack uses, against the reference's (which returns the correction; its
    float32 cumulative sums lose up to ~1e-4 when the ball shrinks a large perturbation a lot)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 3, 16, 16, generator=g)
    delta = torch.randn(16, 3, 16, 16, generator=g) * torch.rand(16, 1, 1, 1, generator=g)
    for eps in (0.5, 4.0, 40.0):
        torch.testing.assert_close(
            l1_projection(x, delta, eps), delta + L1_projection(x, delta, eps), atol=1e-4, rtol=0
        )


# ------------------------------------------------------------------------------ replayed reference draws


class SharedDraws(square_module._Draws):
    """Draws like the reference: per point for the start, one value per iteration shared by the whole batch
    (window corners, eta orientation, signs; the reference draws L2/L1 signs per point, but shared ones keep
    the replay in step for every point even where two trajectories part). Every draw is queued, one queue
    per kind, in the order in which the reference consumes it."""

    def __init__(self, norm, side=16):
        super().__init__(torch.Generator().manual_seed(123), torch.device("cpu"))
        self.norm, self.side = norm, side
        self.ints, self.signs_q, self.flips_q = [], [], []

    def flips(self, shape):  # the start's L2/L1 tiles: one orientation per tile, rows first
        f = super().flips(shape[1:])
        self.flips_q += f.flatten().tolist()
        return f.expand(shape)

    def signs(self, shape, dtype):  # the start: per point
        t = super().signs(shape, dtype)
        if self.norm == "Linf":  # stripes
            self.signs_q.append(t)
        else:  # tiles, rows first
            self.signs_q += [t[:, :, i, j, None, None] for i in range(shape[2]) for j in range(shape[3])]
        return t

    def steps(self, n, n_iter, c, n_windows, dtype):  # one row, shared by every point
        g = self.generator
        corners = torch.rand((1, n_iter, 2 * n_windows), generator=g)
        signs = (2 * torch.randint(0, 2, (1, n_iter, c), generator=g) - 1).to(dtype)
        flips = torch.randint(0, 2, (1, n_iter), generator=g).bool()
        for i in range(n_iter):
            high = torch.tensor(self.side - _square_side(i, 0.8, self.norm, c, self.side))
            self.ints += [int(_corner(corners[0, i, j], high)) for j in range(2 * n_windows)]
            self.signs_q.append(signs[0, i].view(c, 1, 1))
            if self.norm != "Linf":
                self.flips_q.append(bool(flips[0, i]))
        return _StepDraws(corners.expand(n, -1, -1), signs.expand(n, -1, -1), flips.expand(n, -1))


def _replaying_reference(model, norm, eps, n_queries, draws: SharedDraws) -> SquareAttack:
    """The reference, with its random functions replaced by pops from ``draws``' queues."""
    ref = SquareAttack(
        model, norm=norm, eps=eps, n_queries=n_queries, p_init=0.8, n_restarts=1, device="cpu", resc_schedule=False
    )
    ref.random_int = lambda low=0, high=1, shape=(1,): torch.tensor([draws.ints.pop(0)])
    ref.random_choice = lambda shape: draws.signs_q.pop(0).expand(*shape)

    def eta(s):  # the reference's eta, minus its own coin flip
        top, bottom = ref.eta_rectangles(s // 2, s), -ref.eta_rectangles(s - s // 2, s)
        d = torch.cat([top, bottom], 0)
        d = d / (d.pow(2).sum().sqrt() if norm == "L2" else d.abs().sum())
        return d.t() if draws.flips_q.pop(0) else d

    ref.eta = eta
    ref.init_hyperparam(torch.zeros(1, 3, 16, 16))
    return ref


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_replayed_draws_follow_reference(setup, norm, monkeypatch):
    """Given the same random draws, the same trajectories (margins, accepted points, queries)."""
    model, x, y = setup
    keep = _correct(model, x, y)
    x, y = x[keep][:32], y[keep][:32]
    n_queries = 100

    draws = SharedDraws(norm)
    monkeypatch.setattr(square_module, "_Draws", lambda generator, device: draws)
    # The L1 projections differ by round-off (compared above): give the reference ours.
    monkeypatch.setattr(reference_square, "L1_projection", lambda x0, d, eps: l1_projection(x0, d, eps) - d)
    ours = square_attack(model, x, y, norm=norm, eps=EPS[norm], n_queries=n_queries)
    ref_queries, ref_x = _replaying_reference(model, norm, EPS[norm], n_queries, draws).attack_single_run(x, y)

    assert 0 < (~ours.robust).sum() < len(y)  # a non-trivial case
    same = (ours.queries == ref_queries.long()) & ((ours.x_adv - ref_x).flatten(1).abs().amax(1) < 1e-5)
    if norm != "L1":
        assert not (draws.ints or draws.signs_q or draws.flips_q)  # every draw consumed
        assert same.all()
    else:
        # L1 amplifies round-off: the reference computes x + delta + correction, which leaves ulp-sized
        # residues where the projection zeroes a coordinate, and a later window holding only residues gets
        # them normalised to unit mass. Ours keeps that arithmetic, but the window norms' summation order
        # differs, so now and then a point's trajectory parts from the reference's.
        assert same.float().mean() >= 0.6
        assert abs(int(ours.robust.sum()) - int(_correct(model, ref_x, y).sum())) <= 2
    print(f"{norm}: {int(same.sum())}/{len(same)} trajectories identical")


# ------------------------------------------------------------------------------ independent streams


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_statistically_agrees_with_reference(setup, norm):
    """Independent random streams: robust accuracy and queries spent agree within sampling noise.

    Over 8 seeds (93 correctly classified points, 300 queries) both give the same mean robust count
    (38-52 depending on the norm; sd ~2 per run) and mean queries per point (160-210; sd 3-7, the
    reference's larger as its points share their random windows); the bounds are ~2.5 sd of a difference.
    """
    model, x, y = setup
    n_queries = 300
    clean = _correct(model, x, y)
    ours = square_attack(model, x, y, norm=norm, eps=EPS[norm], n_queries=n_queries, generator=0)

    # What SquareAttack.perturb does, keeping the per-point queries it does not return.
    ref = SquareAttack(
        model,
        norm=norm,
        eps=EPS[norm],
        n_queries=n_queries,
        p_init=0.8,
        n_restarts=1,
        seed=0,
        device="cpu",
        resc_schedule=False,
    )
    ref.init_hyperparam(x)
    torch.manual_seed(0)
    ref_queries, ref_x = ref.attack_single_run(x[clean], y[clean])
    ref_robust = _correct(model, ref_x, y[clean])

    n_clean, n_robust, n_robust_ref = int(clean.sum()), int(ours.robust.sum()), int(ref_robust.sum())
    assert 0.3 * n_clean < n_robust < 0.7 * n_clean  # a non-trivial case
    assert abs(n_robust - n_robust_ref) <= 7
    mean_queries, mean_queries_ref = ours.queries[clean].float().mean(), ref_queries.float().mean()
    assert abs(mean_queries - mean_queries_ref) < 0.1 * mean_queries_ref
    print(
        f"{norm}: robust {n_robust} vs {n_robust_ref} of {n_clean}; "
        f"mean queries {mean_queries:.1f} vs {mean_queries_ref:.1f}"
    )


# ------------------------------------------------------------------------------ invariants, determinism


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_invariants(setup, norm):
    model, x, y = setup
    n_queries = 200
    result = square_attack(model, x, y, norm=norm, eps=EPS[norm], n_queries=n_queries, generator=1)
    assert isinstance(result, SquareResult)
    assert result.x_adv.shape == x.shape and result.robust.dtype == torch.bool
    assert result.queries.dtype == torch.int64

    assert result.x_adv.min() >= 0.0 and result.x_adv.max() <= 1.0
    assert (lp_norm(result.x_adv - x, norm) <= EPS[norm] + 1e-5).all()

    clean = _correct(model, x, y)
    with torch.no_grad():
        adv_correct = model(result.x_adv).argmax(1) == y
    # Misclassified clean points: not attacked, reported non-robust with 0 queries.
    assert not result.robust[~clean].any()
    assert (result.queries[~clean] == 0).all() and torch.equal(result.x_adv[~clean], x[~clean])
    # Broken points are misclassified at x_adv; robust points were never, so also not at their best point.
    broken = clean & ~result.robust
    assert broken.any() and result.robust.any()
    assert not adv_correct[broken].any()
    assert adv_correct[result.robust].all()
    # Budget: 1 initial query + n_queries; robust points used all of it.
    assert ((result.queries[clean] >= 1) & (result.queries[clean] <= n_queries + 1)).all()
    assert (result.queries[result.robust] == n_queries + 1).all()


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_deterministic_with_seed(setup, norm):
    model, x, y = setup
    x, y = x[:32], y[:32]
    run = lambda g: square_attack(model, x, y, norm=norm, eps=EPS[norm], n_queries=60, generator=g)  # noqa: E731
    a, b, c = run(5), run(torch.Generator().manual_seed(5)), run(6)
    assert torch.equal(a.x_adv, b.x_adv) and torch.equal(a.robust, b.robust) and torch.equal(a.queries, b.queries)
    assert not torch.equal(a.x_adv, c.x_adv)


def test_forward_only_and_logits_clean(setup):
    model, x, y = setup
    x, y = x[:32], y[:32]
    calls = []

    def counting(inp):
        calls.append(len(inp))
        assert not torch.is_grad_enabled() and not inp.requires_grad
        return model(inp)

    with torch.no_grad():
        logits = model(x)
    a = square_attack(counting, x, y, eps=EPS["Linf"], n_queries=40, generator=0)
    n_calls = len(calls)
    calls.clear()
    b = square_attack(counting, x, y, eps=EPS["Linf"], n_queries=40, generator=0, logits_clean=logits)
    assert len(calls) == n_calls - 1  # the clean forward was skipped
    assert torch.equal(a.x_adv, b.x_adv) and torch.equal(a.queries, b.queries)
    # One iteration per point per pass: each forward only sees the points still under attack.
    calls.clear()
    square_attack(counting, x, y, eps=EPS["Linf"], n_queries=40, generator=0, logits_clean=logits, batch_size=1)
    assert sum(calls) == int(b.queries.sum())


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_speculative_passes_change_the_cost_not_the_result(setup, norm):
    """Several iterations of each point in one pass (while few points are left) give the result of one
    iteration at a time, in fewer passes, none larger than batch_size."""
    model, x, y = setup
    x, y = x[:48], y[:48]
    calls = []

    def counting(inp):
        calls.append(len(inp))
        return model(inp)

    one = square_attack(counting, x, y, norm=norm, eps=EPS[norm], n_queries=300, generator=3, batch_size=1)
    one_calls, calls[:] = list(calls), []
    many = square_attack(counting, x, y, norm=norm, eps=EPS[norm], n_queries=300, generator=3, batch_size=128)
    assert 0 < one.robust.sum() < (~one.robust).sum()  # a non-trivial case: points broken at many iterations
    assert torch.equal(one.robust, many.robust) and torch.equal(one.queries, many.queries)
    torch.testing.assert_close(one.x_adv, many.x_adv, atol=1e-6, rtol=0)
    assert max(calls) <= 128 and len(calls) < len(one_calls) / 2


# ------------------------------------------------------------------------------ the path GPUs take


def _counted(model, calls):
    def counting(inp):
        calls.append(len(inp))
        return model(inp)

    return counting


@pytest.mark.parametrize("batch_size", [None, 128])
@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_device_path_gives_the_cpu_path_result(setup, norm, batch_size, monkeypatch):
    """Where reads are not cheap, broken points and points out of queries stay in the batch, masked, until a
    read: every point's result is the one of the CPU path (which compacts before every pass), for a few more
    rows forwarded. batch_size 128: several iterations per point per pass, the retired rows taking some."""
    model, x, y = setup
    x, y = x[:48], y[:48]
    kwargs = dict(norm=norm, eps=EPS[norm], n_queries=300, generator=3, batch_size=batch_size)
    cpu_calls, device_calls = [], []
    with HostReads() as cpu_reads:
        cpu = square_attack(_counted(model, cpu_calls), x, y, **kwargs)
    force_device_path(monkeypatch)
    with HostReads() as device_reads:
        device = square_attack(_counted(model, device_calls), x, y, **kwargs)

    broken = ~cpu.robust & (cpu.queries > 0)
    assert cpu.robust.any() and broken.sum() >= 10 and len(cpu.queries[broken].unique()) >= 10  # broken at many
    assert torch.equal(device.robust, cpu.robust) and torch.equal(device.queries, cpu.queries)
    torch.testing.assert_close(device.x_adv, cpu.x_adv, atol=1e-6, rtol=0)
    # The CPU path reads back before every pass; the device path after passes 1, 2, 4, ... (plus the start's
    # read and at most as many reads near the end), at the cost of a few more passes and rows.
    passes = len(device_calls) - 2  # the clean forward and the start's
    assert len(cpu_reads.calls) >= len(cpu_calls) - 2
    assert len(device_reads.calls) <= 1 + 2 * (int(math.log2(passes)) + 1), device_reads.listing()
    assert len(device_calls) <= 1.25 * len(cpu_calls) and sum(device_calls) <= 1.25 * sum(cpu_calls)


def test_device_path_reads_back_logarithmically_often(setup, monkeypatch):
    """On the device path the reads grow with log2 of the passes: 8 times the queries, 3 more reads when
    nothing breaks (one pass per query); when points break and a pass takes several iterations per point, a
    few more at most (reads where every point may be done)."""
    model, x, y = setup
    x, y = x[:32], y[:32]
    clean = int(_correct(model, x, y).sum())
    force_device_path(monkeypatch)
    counts = {}
    for eps, batch_size in ((1e-4, None), (EPS["Linf"], 96)):
        for n_queries in (50, 400):
            calls = []
            with HostReads() as reads:
                result = square_attack(
                    _counted(model, calls), x, y, eps=eps, n_queries=n_queries, generator=0, batch_size=batch_size
                )
            ops = [op for op, _ in reads.calls]
            # The start's read (which points are correctly classified), then one number per compaction.
            assert ops[0] == "aten.nonzero.default" and set(ops[1:]) == {"aten._local_scalar_dense.default"}
            assert all("square.py" in where for _, where in reads.calls), reads.listing()
            passes = len(calls) - 2  # the clean forward and the start's
            assert len(ops) <= 1 + 2 * (int(math.log2(passes)) + 1), reads.listing()
            counts[eps, n_queries] = len(ops), passes, int(result.robust.sum())
    # Nothing breaks at eps 1e-4: one iteration per pass, reads after passes 1, 2, 4, ... below the budget
    # (the end is known without a read), and the start's.
    assert counts[1e-4, 50] == (1 + 6, 50, clean) and counts[1e-4, 400] == (1 + 9, 400, clean)
    (few, few_passes, _), (many, many_passes, robust) = counts[EPS["Linf"], 50], counts[EPS["Linf"], 400]
    assert 0 < robust < clean and many_passes > 5 * few_passes  # points broken, many more passes
    assert few <= many <= few + 4


def test_rejects_bad_arguments(setup):
    model, x, y = setup
    with pytest.raises(ValueError, match="square"):
        square_attack(model, x[:, :, :, :15], y, eps=0.1)
    with pytest.raises(ValueError, match="norm"):
        square_attack(model, x, y, norm="L0", eps=0.1)
    with pytest.raises(ValueError, match="int64"):
        square_attack(model, x, y.int(), eps=0.1)
