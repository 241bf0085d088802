"""Square Attack (Andriushchenko et al., ECCV 2020): a score-based black-box attack, Linf / L2 / L1.

It reproduces the configuration of standard AutoAttack (``pyautoattack.square.SquareAttack`` with
``p_init=0.8``, ``n_restarts=1``, ``loss="margin"``, ``resc_schedule=False``, 5000 queries), including
the L1 variant of Croce et al. (2022): the same initialisations (vertical stripes for Linf, tiles of
+-"eta" patterns for L2 / L1, the latter projected onto the L1 ball intersected with the box), the same
schedule of the square size p, the same window updates, margin loss, acceptance only of strict
improvements (or of a misclassified point), the query budget, and early stop of broken points.

Only forward passes are made (under ``torch.no_grad``), on the shrinking set of points not yet broken.
While fewer points are left than a forward pass can take (``batch_size``), each point evaluates its next
few iterations in one pass, all proposed from its current best point: a rejected proposal leaves the state
unchanged, so the proposals after it are the ones the sequential attack would make, up to the first
accepted one, after which the rest are dropped. The random numbers are drawn up front per point and per
iteration, so this speculation changes how many forward passes are made, not what any point does: the result
is the one-iteration-at-a-time result (up to float rounding of the model in a larger batch).

What is read back to the host (on a GPU each read waits for the device's queue to drain): once at the start,
how many points are correctly classified (the draw tables are sized by it), and then one number per
compaction, where the broken points and those out of queries leave the batch: how many points are left and
the fewest iterations any of them has spent. On the CPU, where a read costs nothing, the batch is compacted
before every forward pass. Elsewhere it is read only after forward passes 1, 2, 4, 8, ..., and, while a pass
takes several iterations per point, also at the first pass after which every point may be out of queries
(at most as many of these reads as of the former): at most 2 (log2(passes) + 1) reads in the loop. Between
reads, the points that are done stay in the batch, masked (they accept nothing and spend no queries), so
every point's trajectory is the one of compacting before every pass; only a few more rows are forwarded.
Each pass spends at least one iteration of every point still live, so the loop ends without a read once the
fewest iterations last read, plus the passes made since, reach the budget.

Deviations from the reference (none changes the distribution of any single point's trajectory):

* The random windows, signs and eta orientations are drawn independently per point; the reference draws
  one window (and, for Linf, one sign per channel; for L2/L1 one eta orientation) per iteration shared by
  the whole batch. Each point sees the same distribution; only the correlation between points is gone.
  The random numbers come from ``torch`` via ``generator``, so the streams differ from the reference's.
  A window corner is ``floor(high * U)`` like the reference's, from a float32 U drawn up front.
* A point counts as broken when ``argmax(logits) != y`` (the reference stops at margin <= 0 but later
  reports robustness from the argmax; they differ only for exact logit ties).
* The L1 projection is :func:`~robust_lightning.attacks.projections.l1_projection` (exact up to float
  rounding; the reference's float32 cumulative sums can be off by ~1e-5), and L1 iterates are clipped to
  [0, 1] to remove round-off.
* For images smaller than the reference supports (side < 5, or sides where its L2/L1 initial tiles
  would overflow the image), the initial tiles are shrunk / dropped to fit instead of failing.

Reference quirks kept on purpose: window corners are drawn from {0, ..., side - s - 1} (never touching
the last row/column unless s = side); the L1 update's budget has the reference's extra factor C; L1
iterates are computed as ``x + delta + correction`` (see :func:`_l1_to_ball`).
"""

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from robust_lightning.devices import host_reads_are_cheap

from .apgd import Model, StopPoint
from .projections import check_count, check_threat_model, l1_projection

# a stop is asked every this many passes: one pass is a forward of the live points, and 5000 of them on a large
# model outlast a scheduler's grace period (SLURM's KillWait after SIGTERM)
STOP_CHECK_PASSES = 50

# Iteration indices after which p halves (the reference's schedule for 10000 queries; AutoAttack uses it
# unrescaled with 5000 queries, i.e. ``resc_schedule=False``).
_P_BREAKPOINTS = (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)


@dataclass
class SquareResult:
    x_adv: Tensor  # misclassified point for broken inputs; lowest-margin point found (or x) otherwise
    robust: Tensor  # bool per point: correctly classified at x and at every query
    queries: Tensor  # int64 per point: forward passes spent on it (0 if misclassified clean, else 1 + iters)


# ------------------------------------------------------------------------------------ random draws


@dataclass
class _StepDraws:
    """The iterations' random numbers, indexed [point, iteration]."""

    corners: Tensor  # float32 U in [0, 1), (n, n_iter, 2 per window): window corners floor(high * U)
    signs: Tensor  # +-1 per channel (n, n_iter, c), the data's dtype
    flips: Tensor  # bool (n, n_iter): transpose the eta pattern (L2 / L1)


class _Draws:
    """All random numbers of the attack, drawn on the generator's device and moved to the data's device.

    The start's are drawn when it is built; the iterations' come as one table per point and per iteration
    (:meth:`steps`), so what a point draws at its i-th iteration depends neither on which other points are
    still attacked nor on how many of its iterations one forward pass evaluates (about 30 bytes per point
    and iteration with 3 channels: 36 MB for 250 points and 5000 queries). Kept in one place so that
    the distributions are easy to check against the reference (and so a test can substitute draws shared
    across the batch, to replay the reference exactly).
    """

    def __init__(self, generator: torch.Generator | None, device: torch.device):
        self.generator = generator
        self.device = device
        self.source = generator.device if generator is not None else device

    def _randint(self, high: int, shape: Sequence[int]) -> Tensor:
        return torch.randint(0, high, tuple(shape), generator=self.generator, device=self.source).to(self.device)

    def signs(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """Independent +-1 entries."""
        return (2 * self._randint(2, shape) - 1).to(dtype)

    def flips(self, shape: Sequence[int]) -> Tensor:
        """Bool: transpose the eta pattern (probability 1/2)."""
        return self._randint(2, shape).bool()

    def steps(self, n: int, n_iter: int, c: int, n_windows: int, dtype: torch.dtype) -> _StepDraws:
        corners = torch.rand((n, n_iter, 2 * n_windows), generator=self.generator, device=self.source)
        return _StepDraws(corners.to(self.device), self.signs((n, n_iter, c), dtype), self.flips((n, n_iter)))


def _corner(u: Tensor, high: Tensor) -> Tensor:
    """Window corner uniform on {0, ..., high - 1} (0 if high == 0): the reference's ``floor(high * U)``,
    which never places a window against the last row/column."""
    return torch.minimum((u * high).floor().long(), (high - 1).clamp(min=0))


def _as_generator(generator: torch.Generator | int | None, device: torch.device) -> torch.Generator | None:
    """A seed becomes a fresh generator on the data's device; None means the global RNG."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return torch.Generator(device=device).manual_seed(int(generator))


# ------------------------------------------------------------------------------------ schedule, patterns


def _p_selection(it: int, p_init: float) -> float:
    """Fraction of pixels in a square at iteration ``it`` (0-based): p_init halves after each breakpoint."""
    return p_init / 2.0 ** sum(it > b for b in _P_BREAKPOINTS)


def _square_side(it: int, p_init: float, norm: str, c: int, h: int) -> int:
    """Side of the square window at iteration ``it`` (L2/L1: odd and >= 3, as in the reference)."""
    n_features = c * h * h
    # p * n_features / c rather than p * h * w: the same float rounding as the reference.
    s = round(math.sqrt(_p_selection(it, p_init) * n_features / c))
    if norm == "Linf":
        s = max(s, 1)
    else:
        s = max(s, 3)
        s += 1 - s % 2
    return min(s, h)


def _rectangle(a: int, b: int, power: int, norm: str) -> Tensor:
    """The reference's ``eta_rectangles``: (a, b) pattern peaked at the centre, normalised in ``norm``.

    The reference adds 1 / (k + 1)^power on the Chebyshev ball of radius k around (a // 2, b // 2) for
    k < max(a // 2, b // 2) + 1; so entry (i, j) is the tail sum over k >= its Chebyshev distance.
    """
    if a == 0:
        return torch.zeros(0, b, dtype=torch.float64)
    n_rings = max(a // 2 + 1, b // 2 + 1)
    weights = 1.0 / torch.arange(1, n_rings + 1, dtype=torch.float64) ** power
    tail = weights.flip(0).cumsum(0).flip(0)  # tail[d] = sum_{k >= d} weights[k]
    rows = (torch.arange(a) - a // 2).abs()[:, None]
    cols = (torch.arange(b) - b // 2).abs()[None, :]
    rect = tail[torch.maximum(rows, cols)]
    return rect / (rect.pow(2).sum().sqrt() if norm == "L2" else rect.abs().sum())


@cache
def _eta_pair(s: int, norm: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(2, s, s): the reference's ``eta(s)`` for L2 (weights 1/k^2) or L1 (1/k^4) and its transpose.

    Top half positive, bottom half negative, normalised to unit L2 (L2) or unit L1 (L1) norm. Cached: it
    only depends on s, and the reference rebuilds it with Python loops at every iteration.
    """
    power = 2 if norm == "L2" else 4
    eta = torch.cat([_rectangle(s // 2, s, power, norm), -_rectangle(s - s // 2, s, power, norm)], 0)
    eta = eta / (eta.pow(2).sum().sqrt() if norm == "L2" else eta.abs().sum())
    return torch.stack([eta, eta.t()]).to(device=device, dtype=dtype)


def _eta_table(schedule: list[int], norm: str, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The eta pairs of every side in the schedule (a few sides), zero-padded to the largest side S:
    (sides, 2, S, S), and each iteration's row in that table (n_queries,).

    A proposal's pattern is then a lookup (``table[row[it], flip]``), so the host never needs to know which
    sides a forward pass holds (zero padding changes no placed value, see :func:`_place`)."""
    distinct = sorted(set(schedule))
    size = max(distinct, default=0)
    table = torch.zeros(len(distinct), 2, size, size, dtype=dtype, device=device)
    for k, side in enumerate(distinct):
        table[k, :, :side, :side] = _eta_pair(side, norm, dtype, device)
    row = {side: k for k, side in enumerate(distinct)}
    return table, _filled([row[side] for side in schedule], device)


def _filled(values: list[int], device: torch.device) -> Tensor:
    """int64 tensor of ``values``, a few runs of equal values (the schedule's), filled run by run on the device:
    no copy from pageable host memory (on a GPU each waits for the device's queue)."""
    t = torch.empty(len(values), dtype=torch.int64, device=device)
    start = 0
    for value, run in itertools.groupby(values):
        end = start + len(list(run))
        t[start:end] = value
        start = end
    return t


def _place(patterns: Tensor, vh: Tensor, vw: Tensor, sides: Tensor, h: int) -> tuple[Tensor, Tensor]:
    """Put per-proposal patterns (..., S, S), of sides ``sides`` (...), into (..., 1, h, h) images with
    top-left corners (vh, vw).

    Returns (images, window mask): zero / False outside the window. A gather, so no loop over proposals.
    """
    size = patterns.shape[-1]
    grid = torch.arange(h, device=vh.device)
    r, c = grid - vh[..., None], grid - vw[..., None]  # position inside the window
    mask = _window_mask(vh, vw, sides, h)
    inside = r.clamp(0, size - 1)[..., :, None] * size + c.clamp(0, size - 1)[..., None, :]  # (..., h, h)
    placed = patterns.flatten(-2).gather(-1, inside.flatten(-2)).view(inside.shape).unsqueeze(-3) * mask
    return placed, mask


def _window_mask(vh: Tensor, vw: Tensor, sides: Tensor, h: int) -> Tensor:
    """(..., 1, h, h) bool mask of the windows with top-left corners (vh, vw) and sides ``sides`` (...)."""
    grid = torch.arange(h, device=vh.device)
    rows = (grid >= vh[..., None]) & (grid < (vh + sides)[..., None])
    cols = (grid >= vw[..., None]) & (grid < (vw + sides)[..., None])
    return (rows[..., :, None] & cols[..., None, :]).unsqueeze(-3)


# ------------------------------------------------------------------------------------ norm helpers


def _norm_per(t: Tensor, norm: str, dims: tuple[int, ...]) -> Tensor:
    """L2 or L1 norm over ``dims``, kept for broadcasting (same formulas as the reference)."""
    if norm == "L2":
        return t.pow(2).sum(dims, keepdim=True).sqrt()
    return t.abs().sum(dims, keepdim=True)


def _l2_to_ball(x: Tensor, delta: Tensor, eps: float) -> Tensor:
    """The reference's L2 iterate: rescale the perturbation to norm eps, then clip to [0, 1]."""
    return (x + delta / (_norm_per(delta, "L2", (-3, -2, -1)) + 1e-12) * eps).clamp(0.0, 1.0)


def _l1_to_ball(x: Tensor, delta: Tensor, eps: float) -> Tensor:
    """The reference's L1 iterate: project onto the L1 ball (radius shrunk by 1e-6) and the box.

    Computed as ``x + delta + correction`` like the reference, not ``x + projected``: where the projection
    zeroes a coordinate, that rounding leaves ulp-sized residues, which the next update normalises to a
    unit-mass pattern if they fall in its window. Keeping the arithmetic keeps that behaviour (and lets a
    test replay the reference exactly). The clip only removes round-off beyond [0, 1].
    """
    images = delta.reshape(-1, *delta.shape[-3:])  # the projection takes one batch dimension
    projected = l1_projection(x.expand_as(delta).reshape(images.shape), images, eps * (1.0 - 1e-6))
    return (x + delta + (projected.view_as(delta) - delta)).clamp(0.0, 1.0)


# ------------------------------------------------------------------------------------ init and updates


def _init(x: Tensor, norm: str, eps: float, draws: _Draws) -> Tensor:
    """The reference's starting points."""
    n, c, h, _ = x.shape
    if norm == "Linf":
        # Vertical stripes: +-eps per (channel, column).
        return (x + eps * draws.signs((n, c, 1, h), x.dtype)).clamp(0.0, 1.0)

    # L2 / L1: a grid of s x s tiles (s = h // 5, grid centred), each +-eta (one sign per channel, a
    # random orientation per tile).
    s = max(h // 5, 1)
    start = max((h - 5 * s) // 2, 0)
    k = min(h // s, (h - start) // s)  # tiles per side; the reference's h // s whenever they fit
    flips = draws.flips((n, k, k))
    signs = draws.signs((n, c, k, k), x.dtype)
    tiles = _eta_pair(s, norm, x.dtype, x.device)[flips.long()]  # (n, k, k, s, s)
    block = (signs[..., None, None] * tiles[:, None]).permute(0, 1, 2, 4, 3, 5).reshape(n, c, k * s, k * s)
    delta = torch.zeros_like(x)
    delta[:, :, start : start + k * s, start : start + k * s] = block
    return _l2_to_ball(x, delta, eps) if norm == "L2" else _l1_to_ball(x, delta, eps)


# The proposals below take the points (n, C, H, H) and draws with any leading dimensions ending in n (the
# main loop's (iterations ahead, n)), and return images of the draws' shape: the points are broadcast, not
# copied per proposal.


def _propose_linf(x: Tensor, x_best: Tensor, sides: Tensor, eps: float, corners: Tensor, signs: Tensor) -> Tensor:
    """Move one window per proposal (all channels) to a random vertex: +-2 eps per channel, then clip."""
    h = x.shape[-1]
    vh, vw = _corner(corners[..., 0], h - sides), _corner(corners[..., 1], h - sides)
    step = _window_mask(vh, vw, sides, h) * (2.0 * eps * signs[..., None, None])
    # The eps-ball and the box in one clamp: the same values as clipping to one and then the other.
    return (x_best + step).clamp((x - eps).clamp(min=0.0), (x + eps).clamp(max=1.0))


def _propose_lp(
    x: Tensor, x_best: Tensor, sides: Tensor, norm: str, eps: float, corners: Tensor, signs: Tensor, patterns: Tensor
) -> Tensor:
    """L2 / L1 update: clear a second random window and pour its mass (and the unused budget) into the
    first, as a fresh +-eta pattern (``patterns``: (..., S, S), of side ``sides``, zero-padded) added to the
    first window's normalised old content (per channel).

    Written on full-size images with window masks, so every proposal gets its own windows without a loop.
    """
    c, h = x.shape[-3], x.shape[-1]
    delta = x_best - x
    vh, vw, vh2, vw2 = (_corner(corners[..., i], h - sides) for i in range(4))
    eta, mask1 = _place(patterns, vh, vw, sides, h)
    mask2 = _window_mask(vh2, vw2, sides, h)

    hw = (-2, -1)
    window1 = delta * mask1
    norm_window1 = _norm_per(window1, norm, hw)  # (..., c, 1, 1)
    norm_windows = _norm_per(delta * (mask1 | mask2), norm, hw)  # the mass the two windows hold
    norm_image = _norm_per(delta, norm, (-3, -2, -1))  # (n, 1, 1, 1)

    new = eta * signs[..., None, None] + window1 / (1e-12 + norm_window1)
    if norm == "L2":
        budget = ((eps**2 - norm_image**2).clamp(min=0.0) / c + norm_windows**2).sqrt()
    else:  # the reference's L1 formula (the final projection restores the eps budget)
        budget = ((eps - norm_image).clamp(min=0.0) / c + norm_windows) * c
    new = new / (1e-12 + _norm_per(new, norm, hw)) * budget

    delta = torch.where(mask1, new, torch.where(mask2, 0.0, delta))
    return _l2_to_ball(x, delta, eps) if norm == "L2" else _l1_to_ball(x, delta, eps)


def _margin(model: Model, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """(margin z_y - max_{i != y} z_i in float32, misclassified) for one forward pass."""
    z = model(x).float()
    z_y = z.gather(1, y[:, None]).squeeze(1)
    z_other = z.scatter(1, y[:, None], float("-inf")).amax(1)
    return z_y - z_other, z.argmax(1) != y


# ------------------------------------------------------------------------------------ the attack


def square_attack(
    model: Model,
    x: Tensor,
    y: Tensor,
    *,
    norm: str = "Linf",
    eps: float,
    n_queries: int = 5000,
    p_init: float = 0.8,
    generator: torch.Generator | int | None = None,
    logits_clean: Tensor | None = None,
    batch_size: int | None = None,
    stop_point: StopPoint = lambda: None,
) -> SquareResult:
    """Untargeted Square Attack with the margin loss on the batch ``x`` (B, C, H, H), values in [0, 1].

    Args:
        model: callable batch -> logits (B, C), called as is (put it in eval mode); forward passes only.
        y: int64 labels (B,).
        norm: "Linf", "L2" or "L1"; ``eps`` the radius of the ball.
        n_queries: iterations after the initial query, so at most ``n_queries + 1`` queries per point.
        p_init: initial fraction of pixels in a square.
        generator: ``torch.Generator`` (ideally on ``x``'s device), an int seed, or None (global RNG).
        logits_clean: the model's logits on ``x``, if already known (saves one forward pass; not counted
            as a query either way).
        batch_size: rows a forward pass may take (default: ``len(x)``). While fewer points are left, each
            evaluates its next ``batch_size // points left`` iterations in one pass (see the module
            docstring); 1 evaluates one iteration per point per pass.
        stop_point: called every ``STOP_CHECK_PASSES`` passes; it raises to stop the attack (a job's stop signal).

    Points misclassified at ``x`` are not attacked: ``robust`` False, ``queries`` 0, ``x_adv = x``.
    """
    check_threat_model(norm, eps)
    check_count("n_queries", n_queries, 0)
    if not 0 < p_init <= 1:
        raise ValueError(f"p_init must be in (0, 1], got {p_init}")
    if x.dim() != 4 or x.shape[2] != x.shape[3]:
        raise ValueError(f"x must be a batch of square images (B, C, H, H), got shape {tuple(x.shape)}")
    if y.shape != x.shape[:1] or y.dtype != torch.int64:
        raise ValueError(f"y must be int64 of shape ({x.shape[0]},), got {y.dtype} of shape {tuple(y.shape)}")
    batch_size = x.shape[0] if batch_size is None else batch_size
    check_count("batch_size", batch_size, 1)

    with torch.no_grad():
        x = x.detach()
        c, h = x.shape[1], x.shape[2]
        draws = _Draws(_as_generator(generator, x.device), x.device)
        if logits_clean is None:
            logits_clean = model(x)
        correct = logits_clean.argmax(1) == y

        x_adv = x.clone()
        robust = correct.clone()
        queries = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)

        # State of the points under attack (only those are forwarded). One read back: how many points are
        # attacked sizes the draw tables (so a point's draws do not depend on the path).
        active = correct.nonzero().squeeze(1)
        if active.numel() == 0:
            return SquareResult(x_adv, robust, queries)
        x_a, y_a = x[active], y[active]
        x_best = _init(x_a, norm, eps, draws)
        margin_best, fooled = _margin(model, x_best, y_a)
        steps = draws.steps(len(active), n_queries, c, 1 if norm == "Linf" else 2, x.dtype)
        slot = torch.arange(len(active), device=x.device)  # each point's row in the draw table
        done = torch.zeros(len(active), dtype=torch.int64, device=x.device)  # iterations spent per point
        schedule = [_square_side(i, p_init, norm, c, h) for i in range(n_queries)]
        sides = _filled(schedule, x.device)
        if norm != "Linf":
            etas, eta_row = _eta_table(schedule, norm, x.dtype, x.device)

        # Points retire (broken, or out of queries) at a compaction, after the one read back of the loop (see
        # the module docstring). On the CPU a read costs nothing, so it compacts before every pass: the fewest
        # rows forwarded. Elsewhere the retired points stay in the batch between reads, masked.
        cheap = host_reads_are_cheap(x)
        passes, spare = 0, 0  # spare: reads allowed besides those after passes 1, 2, 4, 8, ...
        least_done, least_done_at = 0, 0  # every live point had spent >= least_done iterations at pass least_done_at
        while True:
            if passes and passes % STOP_CHECK_PASSES == 0:
                stop_point()
            retire = fooled | (done == n_queries)
            # Passes since the last read, and iterations per point in each of them (the batch is unchanged since).
            since, ahead = passes - least_done_at, max(1, batch_size // len(active))
            if cheap:
                read = True
            elif least_done + since >= n_queries:  # each pass spends >= 1 iteration of every live point: none left
                read, n_live = False, 0
            elif passes > 0 and passes & (passes - 1) == 0:  # after passes 1, 2, 4, 8, ...
                read, spare = True, spare + 1
            elif spare and least_done + since * ahead >= n_queries:  # the first pass after which none may be left
                read, spare = True, spare - 1
            else:
                read, n_live = False, len(active)
            if read:  # the live points' count and their fewest iterations spent, packed in one number
                packed = (~retire).sum() * (n_queries + 1) + torch.where(retire, n_queries, done).min()
                n_live, least_done = divmod(int(packed), n_queries + 1)
                least_done_at = passes
            if n_live < len(active):
                order = retire.to(torch.uint8).argsort(stable=True)  # the live points first, in their order
                keep, gone = order[:n_live], order[n_live:]
                x_adv[active[gone]], robust[active[gone]] = x_best[gone], ~fooled[gone]
                queries[active[gone]] = 1 + done[gone]
                active, x_a, y_a, x_best, margin_best, fooled, done, slot = (
                    t[keep] for t in (active, x_a, y_a, x_best, margin_best, fooled, done, slot)
                )
                if n_live == 0:
                    break

            # The next `ahead` iterations of every point, all proposed from its current best point. Iterations
            # past a point's budget (only near the end) are evaluated too, to keep the shape, and never accepted.
            n, ahead = len(active), max(1, batch_size // len(active))
            iteration = done + torch.arange(ahead, device=x.device)[:, None]  # (ahead, n)
            in_budget = iteration < n_queries
            it = iteration.clamp(max=n_queries - 1)
            corners, signs = steps.corners[slot, it], steps.signs[slot, it]
            if norm == "Linf":
                x_new = _propose_linf(x_a, x_best, sides[it], eps, corners, signs)
            else:
                patterns = etas[eta_row[it], steps.flips[slot, it].long()]
                x_new = _propose_lp(x_a, x_best, sides[it], norm, eps, corners, signs, patterns)
            margin, misclassified = (t.view(ahead, n) for t in _margin(model, x_new.flatten(0, 1), y_a.repeat(ahead)))

            # Each live point takes its first accepted proposal (a strict improvement of the margin, or a
            # misclassified point); the proposals after it were made from a stale best point and are dropped.
            # Broken points waiting for a compaction accept nothing and spend nothing (out of queries, neither).
            live = ~fooled
            accept = ((margin < margin_best) | misclassified) & in_budget & live
            accepted = accept.any(0)
            first = (accept.to(torch.uint8).argmax(0), torch.arange(n, device=x.device))  # argmax: the first maximum
            x_best = torch.where(accepted[:, None, None, None], x_new[first], x_best)
            margin_best = torch.where(accepted, margin[first], margin_best)
            fooled = fooled | (accepted & misclassified[first])
            done = done + torch.where(accepted, first[0] + 1, in_budget.sum(0) * live)
            passes += 1

    return SquareResult(x_adv, robust, queries)
