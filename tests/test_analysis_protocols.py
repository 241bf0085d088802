"""The analyses follow the protocols of the papers (or their public code) they reproduce.

Each check is written against an independent computation and fails on the earlier behaviour: a Euclidean disc
instead of the paper's square neighbourhood, a fresh permutation per measurement instead of one fixed one,
random lesions that may remove the first block, a signed correlation, empty cells between ConvNet stages, a
Fourier grid ending on the Nyquist bin, Gaussian noise where Park & Kim's code adds sign noise in squares.
"""

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import tiny, tiny_vit
from robust_lightning.analysis import attention as attention_module
from robust_lightning.analysis.attention import (
    RestrictedAttention,
    allowed_patch_pairs,
    local_mask,
    patch_permutation,
    permuted_mask,
)
from robust_lightning.analysis.blocks import BlockMap, find_blocks
from robust_lightning.analysis.frequency import (
    FrequencyNoise,
    band_noise,
    code_band_mask,
    code_bands,
    sign_noise,
)
from robust_lightning.analysis.lesion import LesionStudy
from robust_lightning.analysis.representation import (
    LOG_EPS,
    LayerCorrelation,
    LinearCKAAccumulator,
    fourier_grid,
    relative_log_amplitude,
)
from robust_lightning.errors import UserError
from robust_lightning.models.classifier import RobustClassifier

TRAINER = SimpleNamespace(is_global_zero=True)
PL_MODULE = SimpleNamespace(hparams={})


def offline(analysis, net, images, labels=None, mean=None, std=None):
    """``analysis`` reading ``images`` and a RobustClassifier around ``net`` without a Trainer."""
    labels = torch.zeros(len(images), dtype=torch.long) if labels is None else labels
    model = RobustClassifier(net, mean, std).eval()
    analysis.model = lambda pl_module: model
    analysis.images = lambda trainer, pl_module: (images, labels)
    analysis.batches = lambda trainer, pl_module: iter([(images, labels)])
    return model


# --------------------------------------------------------------------------------- restricted attention
def brute_force_pairs(h: int, w: int, d: int) -> int:
    cells = list(itertools.product(range(h), range(w)))
    return sum(1 for (y1, x1), (y2, x2) in itertools.product(cells, cells) if abs(y1 - y2) <= d and abs(x1 - x2) <= d)


def test_local_masks_allow_the_square_neighbourhood_pair_counts_on_a_14x14_grid():
    assert allowed_patch_pairs(local_mask((14, 14), 1, 0), 1) == 196
    assert allowed_patch_pairs(local_mask((14, 14), 1, 1), 1) == 1600  # a Euclidean disc of radius 1 gives 924
    assert allowed_patch_pairs(local_mask((14, 14), 1, 3), 1) == brute_force_pairs(14, 14, 3)
    assert allowed_patch_pairs(local_mask((5, 7), 2, 2), 2) == brute_force_pairs(5, 7, 2)
    mask = local_mask((14, 14), 1, 1)
    assert mask[0].all() and mask[:, 0].all()  # CLS always allowed, both ways
    interior = 1 + 5 * 14 + 5  # patch (5, 5)
    assert mask[interior, 1:].sum() == 9  # itself and its 8 neighbours, diagonals included
    with pytest.raises(UserError, match="whole number of patches"):
        RestrictedAttention(distances=[0, 1.5])


def test_the_control_is_one_fixed_permutation_for_every_distance_block_and_image(monkeypatch):
    assert torch.equal(patch_permutation(16, 3), patch_permutation(16, 3))  # reproducible from the seed
    assert not torch.equal(patch_permutation(16, 3), patch_permutation(16, 4))
    with pytest.raises(UserError, match="one random but fixed permutation"):
        RestrictedAttention(permutations=3)

    calls = []
    real = attention_module.masked

    def recording(net, bmap, masks):
        calls.append(dict(masks))
        return real(net, bmap, masks)

    monkeypatch.setattr(attention_module, "masked", recording)
    analysis = RestrictedAttention(distances=[0, 1, 2], cls_only=[], seed=5, plot=False)
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    offline(analysis, tiny_vit(), images)
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)

    permutation = patch_permutation(16, 5)
    assert section["permutation"] == permutation.tolist()
    permuted_calls = calls[2::2]  # full, then (local, permuted) per distance
    assert len(permuted_calls) == 3
    for d, masks in zip([0, 1, 2], permuted_calls):
        expected = permuted_mask(local_mask((4, 4), 1, d), 1, permutation)
        assert sorted(masks) == [0, 1, 2] and all(torch.equal(m, expected) for m in masks.values())
    rows = section["local"]
    assert [r["allowed_patch_pairs"] for r in rows] == [brute_force_pairs(4, 4, d) for d in (0, 1, 2)]
    assert [r["allowed_fraction"] for r in rows] == [brute_force_pairs(4, 4, d) / 256 for d in (0, 1, 2)]
    assert all(set(r["permuted"]) == {"accuracy"} for r in rows)
    assert section["protocol"]["follows"] == "paper"


# ------------------------------------------------------------------------------------------ lesions
def test_random_lesions_always_keep_the_first_block():
    analysis = LesionStudy(modes=[], random_counts=[1, 2], samples=60, plot=False)
    vit = tiny_vit()
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    offline(analysis, vit, images)
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
    removed = [name for n in ("1", "2") for draw in section["random"]["block"][n]["removed"] for name in draw]
    assert "blocks.0" not in removed
    assert set(removed) == {"blocks.1", "blocks.2"}  # every other block is drawn
    assert section["random_pool"] == ["blocks.1", "blocks.2"]
    with pytest.raises(UserError, match="only 2 units.*first block is always kept"):
        LesionStudy(random_counts=[3]).check(None, SimpleNamespace(model=SimpleNamespace(net=vit)))


# --------------------------------------------------------------------------------------- correlation
class FakeTap:
    def __init__(self, labels):
        self.points = [(label, "block") for label in labels]


def test_layer_correlation_is_the_absolute_pearson_correlation():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 5, 6, generator=gen)
    b = -0.5 * a + 0.3 * torch.randn(8, 5, 6, generator=gen)
    features = [a, -a, b]
    analysis = LayerCorrelation(tokens=["all", "cls"], plot=False)
    bmap = BlockMap("vit", [], tokens=True, num_prefix_tokens=1, has_cls=True)

    def run(trainer, pl_module, consume):
        consume(bmap, features, (8, 8))
        return bmap, FakeTap(["x", "-x", "y"])

    analysis.run = run
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
    assert section["measures"] == {"all": "abs_pearson", "cls": "abs_pearson"}
    assert section["all"][0][1] == pytest.approx(1.0)  # a perfectly anti-correlated pair: |rho| = 1
    expected = abs(np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1])
    assert section["all"][0][2] == pytest.approx(expected, abs=1e-9) and section["all"][0][2] > 0
    cls = abs(np.corrcoef(a[:, 0].flatten().numpy(), b[:, 0].flatten().numpy())[0, 1])
    assert section["cls"][0][2] == pytest.approx(cls, abs=1e-9)
    assert all(v >= 0 for row in section["all"] for v in row)


def numpy_minibatch_cka(batches: list[list[np.ndarray]], i: int, j: int) -> float:
    """Linear CKA of layers i and j from the unbiased HSIC (Song et al. 2012) averaged over batches."""

    def hsic(k, m):
        n = k.shape[0]
        k, m = k.copy(), m.copy()
        np.fill_diagonal(k, 0)
        np.fill_diagonal(m, 0)
        ones = np.ones(n)
        value = (
            np.trace(k @ m)
            + (ones @ k @ ones) * (ones @ m @ ones) / ((n - 1) * (n - 2))
            - 2 / (n - 2) * (ones @ k @ m @ ones)
        )
        return value / (n * (n - 3))

    def gram(x):
        x = x.reshape(len(x), -1).astype(np.float64)
        return x @ x.T

    cross = np.mean([hsic(gram(f[i]), gram(f[j])) for f in batches])
    own_i = np.mean([hsic(gram(f[i]), gram(f[i])) for f in batches])
    own_j = np.mean([hsic(gram(f[j]), gram(f[j])) for f in batches])
    return cross / math.sqrt(own_i * own_j)


def test_a_convnet_with_differently_shaped_stages_gets_linear_cka_in_every_cell():
    net = tiny("test_resnet")
    bmap = find_blocks(net)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.rand(6, 3, 32, 32, generator=gen), torch.rand(5, 3, 32, 32, generator=gen)]
    labels = torch.zeros(6, dtype=torch.long)
    analysis = LayerCorrelation(tokens=["all"], plot=False)
    offline(analysis, net, batches[0])
    analysis.batches = lambda trainer, pl_module: iter([(x, labels[: len(x)]) for x in batches])
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
    matrix = section["all"]
    assert section["measures"] == {"all": "linear_cka"} and len(matrix) == len(bmap.units) == 4
    assert all(v is not None and math.isfinite(v) for row in matrix for v in row)  # no empty cells
    assert all(matrix[i][i] == pytest.approx(1.0) for i in range(4))

    # independently: the units' outputs through forward hooks, CKA from the formula in numpy
    outputs: list[list[np.ndarray]] = []
    hooks = [
        net.get_submodule(u.paths[0]).register_forward_hook(
            lambda m, args, out: outputs[-1].append(out.detach().numpy())
        )
        for u in bmap.units
    ]
    with torch.no_grad():
        for x in batches:
            outputs.append([])
            net(x)
    for h in hooks:
        h.remove()
    assert len({o.shape[1:] for o in outputs[0]}) > 1  # the stages really differ in shape
    for i, j in [(0, 1), (0, 3), (2, 3)]:
        assert matrix[i][j] == pytest.approx(numpy_minibatch_cka(outputs, i, j), rel=1e-6)
    with pytest.raises(UserError, match="batches of at least 4"):
        LinearCKAAccumulator().matrix(2)
    with pytest.raises(UserError, match="measure"):
        LayerCorrelation(measure="pearson")


def test_linear_cka_is_invariant_to_rotation_and_scale_of_a_representation():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 10, generator=gen)
    rotation, _ = torch.linalg.qr(torch.randn(10, 10, generator=gen))
    acc = LinearCKAAccumulator()
    acc.add([x, 3 * x @ rotation, torch.randn(16, 4, 2, generator=gen)])
    cka = acc.matrix(3)
    assert cka[0, 1].item() == pytest.approx(1.0) and abs(cka[0, 2].item()) < 0.5


# ------------------------------------------------------------------------------------------- Fourier
def numpy_notebook_fourier(maps: np.ndarray) -> np.ndarray:
    """Park & Kim's fourier_analysis.ipynb for (B, C, n, n) maps: the relative log amplitudes it plots."""
    h, w = maps.shape[-2:]
    f = np.log(np.abs(np.fft.fft2(maps)) + 1e-6)
    f = np.roll(f, shift=(int(h / 2), int(w / 2)), axis=(2, 3)).mean(axis=(0, 1))
    latent = np.diag(f)[int(h / 2) :]
    return latent - latent[0]


@pytest.mark.parametrize("size", [14, 7, 8, 1])
def test_fourier_analysis_matches_the_notebook_and_ends_below_nyquist(size):
    maps = torch.randn(3, 4, size, size, generator=torch.Generator().manual_seed(size))
    plotted, relative = relative_log_amplitude(maps)
    expected = numpy_notebook_fourier(maps.double().numpy())
    assert relative.shape[1] == len(expected) == size - size // 2
    assert np.allclose(relative.double().mean(0).numpy(), expected, atol=1e-4)
    assert np.allclose(plotted.numpy(), np.linspace(0, 1, len(expected)))  # the notebook's x axis
    bins, _, true = fourier_grid(size)
    assert bins[-1] == math.ceil(size / 2) - 1 and true[-1].item() == pytest.approx(2 * bins[-1] / size)


def test_the_last_fourier_point_is_not_the_nyquist_bin():
    bins, plotted, true = fourier_grid(14)
    assert bins[-1] == 6 and plotted[-1] == 1.0 and true[-1].item() == pytest.approx(6 / 7)
    rows, cols = torch.meshgrid(torch.arange(14), torch.arange(14), indexing="ij")
    # energy at frequency 0 and at the Nyquist bin (7, 7) only / at frequency 0 and bin (6, 6) only
    nyquist = ((rows + cols) % 2 * 2 - 1 + 2).float().expand(2, 3, 14, 14)
    last = (torch.cos(2 * torch.pi * 6 * (rows + cols) / 14) + 2).float().expand(2, 3, 14, 14)
    # log(eps) - log(2 * 196) at the last point: nothing there (the old grid ended on (7, 7): log(196 / 392))
    assert (relative_log_amplitude(nyquist)[1][:, -1] < math.log(LOG_EPS) - math.log(392) + 1).all()
    assert relative_log_amplitude(last)[1][:, -1] == pytest.approx(torch.full((2,), math.log(98 / 392)), abs=1e-3)


# ------------------------------------------------------------------------------------- frequency noise
def numpy_fourier_mask(x: np.ndarray, f: float, s: float) -> np.ndarray:
    """Park & Kim's FreqAttack._fourier_mask (ops/adversarial.py), written out in numpy."""
    h, w = x.shape[-2:]
    spectrum = np.roll(np.fft.fft2(x), shift=(int(h / 2), int(w / 2)), axis=(2, 3))
    amplitude, angle = np.abs(spectrum), np.angle(spectrum)

    def center_mask(w1, w2):
        w1 = max(min(w1, w2), 0)
        pad = int((w2 - w1) / 2)
        return np.pad(np.ones((1, 3, w1, w1)), ((0, 0), (0, 0), (pad, pad), (pad, pad)))

    mask = center_mask(int(((f + s) * h) / (2 * math.pi)) * 2, h) - center_mask(
        int(((f - s) * h) / (2 * math.pi)) * 2, h
    )
    spectrum = (mask * amplitude) * np.exp(1j * angle)
    return np.fft.ifft2(np.roll(spectrum, shift=(int(h / 2), int(w / 2)), axis=(2, 3))).real


@pytest.mark.parametrize("size", [32, 224])
def test_code_protocol_noise_is_park_and_kims_fourier_mask(size):
    delta = sign_noise((2, 3, size, size), 0.007, torch.Generator().manual_seed(size)).double()
    assert torch.allclose(delta.abs(), torch.full_like(delta, 0.007)) and 0.4 < (delta > 0).double().mean() < 0.6
    for f, s in [(0.0, 0.05 * math.pi), (0.3 * math.pi, 0.05 * math.pi), (math.pi, 0.05 * math.pi), (0.5, 0.2)]:
        ours = band_noise(delta, code_band_mask(size, f, s).double())
        assert np.allclose(ours.numpy(), numpy_fourier_mask(delta.numpy(), f, s), atol=1e-12)
    assert code_bands(0.1) == [round(0.1 * i, 10) for i in range(11)]


def test_frequency_noise_protocols_and_the_code_noise_in_normalised_units():
    with pytest.raises(UserError, match="protocol"):
        FrequencyNoise(protocol="shao")
    code = FrequencyNoise(protocol="code", eps=0.01)
    for odd_or_oblong in [(31, 31), (32, 30)]:
        with pytest.raises(UserError, match="square, even-sized"):
            code.bands(*odd_or_oblong)
    bands = code.bands(32, 32)
    assert [b["centre"] for b, _ in bands] == code_bands(0.1) and len(bands) == 11
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)  # ImageNet's, which Park & Kim's data divide by
    delta = code.delta(torch.zeros(2, 3, 8, 8), torch.Generator().manual_seed(0))
    assert torch.allclose(delta.abs(), (0.01 * std).expand(2, 3, 8, 8))  # eps of normalised input, in pixels
    paper = FrequencyNoise(protocol="paper", noise_std=0.1)
    assert len(paper.bands(30, 30)) == 10  # the text's bands tile the spectrum of any size
    gaussian = paper.delta(torch.zeros(4, 3, 32, 32), torch.Generator().manual_seed(0))
    assert gaussian.std().item() == pytest.approx(0.1, rel=0.05)


def test_the_default_size_is_parks_eps_and_each_band_keeps_its_share_of_the_draw():
    """The default is the sign noise of eps 0.7 ImageNet-normalised units of Park's code (how-do-vits-work issue
    44), not rescaled: the white noise is 0.7 x ImageNet's std in [0, 1] pixels whatever the model's normaliser,
    and a band's energy is its share of the draw's."""
    analysis = FrequencyNoise(plot=False)
    assert (analysis.protocol, analysis.eps, analysis.rms_grey_levels) == ("code", 0.7, None)
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    imagenet_std_rms = float(np.sqrt(np.mean(np.square([0.229, 0.224, 0.225]))))
    white = []
    for std in (0.25, 1.0):  # two normalisers, the same noise
        offline(analysis, tiny("test_resnet"), images, mean=[0.5] * 3, std=[std] * 3)
        section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
        white.append(section["white_noise"]["noise_rms_grey_levels"])
    assert section["conditions"]["eps"] == 0.7 and section["conditions"]["rms_grey_levels"] is None
    assert white == pytest.approx([0.7 * imagenet_std_rms * 255] * 2)
    white = section["white_noise"]["noise_rms_grey_levels"]
    for band in section["bands"]:  # a share of the draw: weaker than the white noise (the band at 0 pi is empty)
        assert (0 < band["noise_rms_grey_levels"] < white) == (band["bins"] > 0), band


def test_every_bands_noise_is_scaled_to_a_stated_size():
    """rms_grey_levels 20.4 (ImageNet-C's mildest Gaussian noise, std 0.08 of [0, 1]): every band and the white
    noise at that RMS, whatever share of the draw's energy the band holds."""
    analysis = FrequencyNoise(protocol="code", rms_grey_levels=20.4, plot=False)
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    offline(analysis, tiny("test_resnet"), images, mean=[0.5] * 3, std=[0.25] * 3)
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
    assert section["conditions"]["rms_grey_levels"] == pytest.approx(0.08 * 255)
    assert section["white_noise"]["noise_rms_grey_levels"] == pytest.approx(20.4, rel=1e-5)
    for band in section["bands"]:  # the code's band at 0 pi holds no DFT bin at 32 px: no noise to scale
        expected = 20.4 if band["bins"] else 0.0
        assert band["noise_rms_grey_levels"] == pytest.approx(expected, rel=1e-5), band
    assert sum(band["bins"] > 0 for band in section["bands"]) == 10
    # the same size whatever the protocol's own draw: eps changes nothing once scaled
    louder = FrequencyNoise(protocol="code", eps=0.5, rms_grey_levels=20.4, plot=False)
    offline(louder, tiny("test_resnet"), images, mean=[0.5] * 3, std=[0.25] * 3)
    for loud, band in zip(louder.analyse(TRAINER, PL_MODULE)[0]["bands"], section["bands"], strict=True):
        assert loud["accuracy"] == band["accuracy"]
        assert loud["noise_rms_grey_levels"] == pytest.approx(band["noise_rms_grey_levels"], rel=1e-5)


def test_frequency_noise_section_records_its_protocol():
    analysis = FrequencyNoise(protocol="code", eps=0.5, rms_grey_levels=None, plot=False)
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    offline(analysis, tiny("test_resnet"), images, mean=[0.5] * 3, std=[0.25] * 3)
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
    assert section["protocol"]["follows"] == "code" and section["conditions"]["eps"] == 0.5
    assert [b["centre"] for b in section["bands"]] == code_bands(0.1)
    assert [b["bins"] for b in section["bands"]] == [
        int(code_band_mask(32, b * math.pi, 0.05 * math.pi).sum()) for b in code_bands(0.1)
    ]
    # the noise's RMS in grey levels: white sign noise of 0.5 ImageNet-normalised units is 0.5 x ImageNet's std in
    # [0, 1] pixels, whatever the model's normaliser; each band's, recomputed here from the same draw with numpy
    imagenet_std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    white = 0.5 * imagenet_std.pow(2).mean().sqrt().item() * 255
    assert section["white_noise"]["noise_rms_grey_levels"] == pytest.approx(white)
    draw = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)).sign()
    delta = (0.5 * draw * imagenet_std).numpy()
    for band in section["bands"]:
        mask = code_band_mask(32, band["centre"] * math.pi, 0.05 * math.pi).numpy()
        noise = np.fft.ifft2(np.fft.fft2(delta) * mask).real
        assert band["noise_rms_grey_levels"] == pytest.approx(np.sqrt((noise**2).mean()) * 255, rel=1e-6)


# ------------------------------------------------------------------------------------ feature variance
def test_chens_feature_variance_takes_the_variance_of_each_batchs_mean_map():
    """Chen et al.'s script averages a batch's maps over the images before the spatial variance: one image per
    batch gives Park & Kim's per-image variance exactly; several differing images give another number."""
    from robust_lightning.analysis.representation import FeatureVariance

    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(4, dtype=torch.long)
    net = tiny("test_resnet")
    results = {}
    for protocol, batches in (
        ("parkkim", [images]),
        ("chen", [images[i : i + 1] for i in range(4)]),
        ("chen-batch", [images]),
    ):
        analysis = FeatureVariance(protocol=protocol.split("-")[0], plot=False)
        offline(analysis, net, images)
        analysis.batches = lambda trainer, pl_module, batches=batches: iter([(b, labels[: len(b)]) for b in batches])
        section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
        results[protocol] = [p["variance"] for p in section["points"] if p["variance"] is not None]  # 1x1: none
    assert results["chen"] == pytest.approx(results["parkkim"], rel=1e-5)
    assert results["chen-batch"] != pytest.approx(results["parkkim"], rel=1e-3)
    assert (
        section["conditions"]["protocol"] == "chen"
        and "feature_map_variance/main.py" in section["protocol"]["reference"]
    )
    with pytest.raises(UserError, match="FeatureVariance.protocol must be one of parkkim, chen"):
        FeatureVariance(protocol="park")
