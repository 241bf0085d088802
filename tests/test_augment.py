"""Device-side augmentation (robust_lightning.data.augment) against the PIL/timm reference implementations.

Reference outputs come from timm 1.0.31's own op functions driven on PIL images (timm.data.auto_augment),
DeiT III's PIL 3-Augment ops and torchvision's PIL ColorJitter functions.
"""

import math
import random

import numpy as np
import pytest
import timm.data.auto_augment as timm_aa
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageFilter, ImageOps
from timm.data import Mixup

from helpers import HostReads, force_device_path
from robust_lightning.data.augment import (
    GEOMETRIC_OPS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    RAND_AUGMENT_OPS,
    BatchAugment,
    ColorJitter,
    MixUpCutMix,
    RandAugment,
    RandomErasing,
    ThreeAugment,
    parse_rand_augment,
)

COLOUR_OPS = [op for op in RAND_AUGMENT_OPS if op not in GEOMETRIC_OPS]
PIL_FILTERS = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


def smooth_images(n: int = 6, size: int = 32, seed: int = 0) -> list[np.ndarray]:
    """uint8 HWC images of smooth coloured waves (different per image and channel) so every op is visible."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    images = []
    for _ in range(n):
        freq, phase = rng.uniform(1, 3, 3), rng.uniform(0, 2 * np.pi, 3)
        waves = [0.5 + 0.45 * np.sin(2 * np.pi * (freq[c] * x + 0.7 * (c + 1) * y) + phase[c]) for c in range(3)]
        image = np.stack(waves, -1) * rng.uniform(0.4, 1.0) + rng.uniform(0, 0.2)
        images.append(np.clip(np.round(image * 255), 0, 255).astype(np.uint8))
    return images


def to_batch(images: list[np.ndarray]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(a).permute(2, 0, 1) for a in images]).float() / 255


def to_uint8(batch: torch.Tensor) -> np.ndarray:
    return (batch * 255).round().permute(0, 2, 3, 1).numpy().astype(np.int64)


@pytest.fixture(scope="module")
def images():
    return smooth_images()


def timm_op(monkeypatch, name: str, magnitude: float, sign: int, interpolation: str = "bicubic"):
    """timm's AugmentOp, always applied, fixed magnitude, the random sign forced to `sign`."""
    monkeypatch.setattr(timm_aa, "_randomly_negate", (lambda v: -v) if sign < 0 else (lambda v: v))
    fill = tuple(min(255, round(255 * v)) for v in IMAGENET_MEAN)  # timm's img_mean for the ImageNet mean
    hparams = dict(translate_const=100, img_mean=fill, interpolation=PIL_FILTERS[interpolation])
    return timm_aa.AugmentOp(name, prob=1.0, magnitude=magnitude, hparams=hparams)


# ---------------------------------------------------------------------------------- parity with timm / PIL
@pytest.mark.parametrize("name", COLOUR_OPS)
@pytest.mark.parametrize("magnitude", [2.0, 7.3, 9.0])
@pytest.mark.parametrize("sign", [1, -1])
def test_colour_ops_match_timm(monkeypatch, images, name, magnitude, sign):
    op = timm_op(monkeypatch, name, magnitude, sign)
    expected = np.stack([np.asarray(op(Image.fromarray(a))) for a in images]).astype(np.int64)
    ours = to_uint8(RandAugment().apply_op(to_batch(images), name, magnitude, sign))
    # Bit-exact: look-up tables as Pillow builds them (autocontrast's in double precision), blends in float32
    # with truncation like Pillow's C, op arguments computed in double like timm's Python.
    assert np.array_equal(ours, expected)
    assert not np.array_equal(ours, np.stack(images)), "the op should change these images"


@pytest.mark.parametrize("name", ["Equalize", "AutoContrast"])
def test_histogram_ops_match_pil_on_large_images(name):
    # 256 x 256 pixels: Pillow's equalize step (pixels // 255) differs from e.g. pixels // 256 only at sizes
    # like this, and the per-channel look-up tables get 256 possible inputs.
    images = smooth_images(n=2, size=256, seed=5)
    reference = ImageOps.equalize if name == "Equalize" else ImageOps.autocontrast
    expected = np.stack([np.asarray(reference(Image.fromarray(a))) for a in images]).astype(np.int64)
    assert np.array_equal(to_uint8(RandAugment().apply_op(to_batch(images), name, 9.0)), expected)


@pytest.mark.parametrize("name", ["Equalize", "AutoContrast"])
def test_histogram_ops_on_degenerate_histograms(name):
    # a flat image, a constant channel next to a two-level and a three-level one
    flat = np.full((16, 16, 3), 77, np.uint8)
    mixed = np.zeros((16, 16, 3), np.uint8)
    mixed[..., 0] = 200
    mixed[:, 5:, 1] = 31
    mixed[:, :3, 2], mixed[:, 3:9, 2], mixed[:, 9:, 2] = 10, 130, 250
    images = [flat, mixed]
    reference = ImageOps.equalize if name == "Equalize" else ImageOps.autocontrast
    expected = np.stack([np.asarray(reference(Image.fromarray(a))) for a in images]).astype(np.int64)
    assert np.array_equal(to_uint8(RandAugment().apply_op(to_batch(images), name, 9.0)), expected)


def test_posterize_at_full_magnitude_is_black(images):
    # M = 10 keeps 4 - int(4) = 0 bits: black with older Pillow; Pillow 13 raises for 0 bits (timm does not
    # guard against it), so the older behaviour is the reference here.
    out = RandAugment().apply_op(to_batch(images), "PosterizeIncreasing", 10.0)
    assert out.abs().max() == 0


@pytest.mark.parametrize("name", GEOMETRIC_OPS)
@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear", "nearest"])
@pytest.mark.parametrize("magnitude,sign", [(4.0, 1), (9.0, -1), (10.0, 1)])
def test_geometric_ops_match_timm(monkeypatch, images, name, interpolation, magnitude, sign):
    op = timm_op(monkeypatch, name, magnitude, sign, interpolation)
    expected = np.stack([np.asarray(op(Image.fromarray(a))) for a in images]).astype(np.int64)
    ours = to_uint8(RandAugment(interpolation=interpolation).apply_op(to_batch(images), name, magnitude, sign))
    diff = np.abs(ours - expected)
    if interpolation == "nearest":
        # Pillow rotates/shears with nearest in 16.16 fixed point, we in double precision: source points
        # that fall exactly on a pixel boundary (common for shears of whole tenths) may pick the neighbour.
        assert (diff > 0).mean() < 0.05
        return
    # Same filters as Pillow's transform (bicubic a = -1, edge replication, fill outside, truncation), so the
    # whole image - fill borders included - agrees; float32 interpolation vs Pillow's doubles moves an
    # occasional value across a truncation boundary: at most 1/255, and on average < 0.1/255.
    assert diff.max() <= 1
    assert diff.mean() < 0.1
    fill = np.array([round(255 * v) for v in IMAGENET_MEAN])
    assert (ours == fill).all(-1).any(), "the op moved the fill colour in"


def test_three_augment_ops_match_pil(images):
    batch, n = to_batch(images), len(images)
    three = ThreeAugment()
    gray = to_uint8(three.apply(batch, torch.zeros(n, dtype=torch.long), torch.ones(n)))
    assert np.array_equal(gray, np.stack([np.asarray(Image.fromarray(a).convert("L").convert("RGB")) for a in images]))
    solar = to_uint8(three.apply(batch, torch.ones(n, dtype=torch.long), torch.ones(n)))
    assert np.array_equal(solar, np.stack([np.asarray(ImageOps.solarize(Image.fromarray(a))) for a in images]))
    # Pillow's GaussianBlur is three extended box blurs in 8.24 fixed point; ours reproduces it bit for bit.
    radius = torch.tensor([0.1, 0.37, 0.8, 1.0, 1.55, 2.0])
    blur = to_uint8(three.apply(batch, torch.full((n,), 2), radius))
    expected = [
        np.asarray(Image.fromarray(a).filter(ImageFilter.GaussianBlur(float(r)))) for a, r in zip(images, radius)
    ]
    assert np.array_equal(blur, np.stack(expected))


def test_color_jitter_matches_torchvision_on_pil(images):
    jitter = ColorJitter(0.3, 0.3, 0.3)
    factors, order = jitter.sample_params(len(images), torch.Generator().manual_seed(0))
    adjust = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation)
    expected = []
    for image, f, o in zip(images, factors, order):
        pil = Image.fromarray(image)
        for j in o.tolist():
            pil = adjust[j](pil, float(f[j]))
        expected.append(np.asarray(pil))
    assert np.array_equal(to_uint8(jitter.apply(to_batch(images), factors, order)), np.stack(expected))
    assert ((factors >= 0.7) & (factors <= 1.3)).all()
    assert all(sorted(o.tolist()) == [0, 1, 2] for o in order)


# ------------------------------------------------------------------------------------ per-sample randomness
def test_rand_augment_draws_per_sample():
    n = 20000
    params = RandAugment().sample_params(n, torch.Generator().manual_seed(1))
    ops = params["op"].flatten()
    counts = torch.bincount(ops, minlength=len(RAND_AUGMENT_OPS)).double()
    expected = ops.numel() / len(RAND_AUGMENT_OPS)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45  # 14 degrees of freedom: P(chi2 > 45) ~ 4e-5
    assert abs(params["applied"].float().mean().item() - 0.5) < 0.01
    assert abs((params["sign"] > 0).float().mean().item() - 0.5) < 0.01
    # N(9, 0.5) clipped to [0, 10]: 2.3 % of the draws sit at 10, the rest look normal.
    m = params["magnitude"].flatten()
    assert m.min() >= 0 and m.max() == 10
    assert 0.019 < (m == 10).float().mean().item() < 0.027
    below = m[m < 10]
    assert abs(below.median().item() - 9.0) < 0.02
    assert abs(torch.quantile(below, 0.1587).item() - 8.5) < 0.03  # one sigma below the mean
    # the two layers are drawn independently for every image
    assert (params["op"][0] != params["op"][1]).float().mean().item() > 0.9


def test_rand_augment_uniform_magnitude_option():
    m = RandAugment(magnitude=9, magnitude_std=math.inf).sample_magnitudes((20000,), torch.Generator().manual_seed(0))
    assert m.min() >= 0 and m.max() <= 9 and abs(m.mean().item() - 4.5) < 0.1


def test_rand_augment_differs_between_identical_images(images):
    batch = to_batch(images[:1]).expand(48, -1, -1, -1)
    out = RandAugment()(batch, torch.Generator().manual_seed(0))
    distinct = {tuple(to_uint8(o[None]).flatten()[::7]) for o in out}
    assert len(distinct) > 15  # ~1/4 of the images get no op, so some repeat; most differ


def test_batched_result_equals_per_image_ops():
    """The sort-by-op dispatch applies exactly each image's own draws, in order."""
    augment = RandAugment()
    batch = to_batch(smooth_images(n=24, seed=3))
    params = augment.sample_params(len(batch), torch.Generator().manual_seed(5))
    out = augment.apply(batch, params)
    for i in range(len(batch)):
        expected = batch[i : i + 1]
        for layer in range(augment.num_ops):
            if params["applied"][layer, i]:
                name = RAND_AUGMENT_OPS[params["op"][layer, i]]
                expected = augment.apply_op(expected, name, params["magnitude"][layer, i], params["sign"][layer, i])
        assert torch.equal(out[i], expected[0]), i


def test_rand_augment_output_contract():
    batch = to_batch(smooth_images(n=16, seed=1))
    augment = RandAugment()
    out = augment(batch, torch.Generator().manual_seed(0))
    assert out.shape == batch.shape and out.dtype == batch.dtype and out.device == batch.device
    assert out.min() >= 0 and out.max() <= 1
    assert torch.allclose(out * 255, torch.round(out * 255), atol=1e-3)  # on the 8-bit grid, like PIL
    assert torch.equal(out, augment(batch, torch.Generator().manual_seed(0)))
    assert not torch.equal(out, augment(batch, torch.Generator().manual_seed(1)))
    assert augment(batch.double()).dtype == torch.float64
    assert augment(batch).shape == batch.shape  # default RNG


# ---------------------------------------------------------------------------------------- RandomErasing
def test_random_erasing_boxes():
    erasing = RandomErasing(0.25)
    top, left, h, w = erasing.boxes(20000, 64, 48, torch.Generator().manual_seed(0)).unbind(1)
    erased = h > 0
    assert abs(erased.float().mean().item() - 0.25) < 0.015
    assert (h[~erased] == 0).all() and (w[~erased] == 0).all()
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 64).all() and (left + w <= 48).all()
    assert (h[erased] < 64).all() and (w[erased] < 48).all()
    # area U(0.02, 1/3) of the image, with h and w rounded to whole pixels
    area = (h * w)[erased].float() / (64 * 48)
    assert area.min() > 0.015 and area.max() < 0.36
    aspect = (h.float() / w.float())[erased]
    assert aspect.min() > 0.25 and aspect.max() < 4.0


def test_random_erasing_box_distribution_matches_timm():
    from timm.data.random_erasing import RandomErasing as TimmRandomErasing

    random.seed(0)  # timm draws from Python's random
    ones = torch.ones(3000, 3, 64, 48)
    TimmRandomErasing(1.0, mode="const", device="cpu")(ones)  # erases in place with zeros
    erased = ones[:, 0] == 0
    timm_h, timm_w = erased.any(2).sum(1).float(), erased.any(1).sum(1).float()
    _, _, h, w = RandomErasing(1.0).boxes(3000, 64, 48, torch.Generator().manual_seed(0)).float().unbind(1)
    for ours, theirs in ((h, timm_h), (w, timm_w), (h * w, timm_h * timm_w), ((h / w).log(), (timm_h / timm_w).log())):
        assert abs(ours.mean() - theirs.mean()) < 0.05 * theirs.abs().mean() + 0.02
        assert abs(ours.std() - theirs.std()) < 0.05 * theirs.std()


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_random_erasing_fills_only_the_box(mode):
    batch = to_batch(smooth_images(n=32, seed=2))
    erasing = RandomErasing(0.5, mode=mode)
    out = erasing(batch, torch.Generator().manual_seed(3))
    boxes = erasing.boxes(32, 32, 32, torch.Generator().manual_seed(3))  # forward draws its boxes first
    assert out.shape == batch.shape and out.min() >= 0 and out.max() <= 1
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1)
    for image, result, (top, left, h, w) in zip(batch, out, boxes.tolist()):
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top : top + h, left : left + w] = True
        assert torch.equal(result[:, ~inside], image[:, ~inside])  # unerased pixels / images untouched
        if h == 0:
            continue
        patch = result[:, inside]
        if mode == "const":
            assert torch.allclose(patch, mean.expand_as(patch))  # 0 in normalised space
        elif mode == "rand":
            assert torch.equal(patch, patch[:, :1].expand_as(patch))  # one colour per box
        else:
            assert patch.std(1).min() > 0.1  # per-pixel noise, std 0.22 in [0, 1] space before clamping
    assert 8 < (boxes[:, 2] > 0).sum() < 24


def test_random_erasing_pixel_noise_statistics():
    batch = torch.full((64, 3, 32, 32), 0.5)
    out = RandomErasing(1.0, mode="pixel")(batch, torch.Generator().manual_seed(0))
    noise = out[out != 0.5].view(-1)
    assert noise.numel() > 10000
    erased = out != 0.5
    for c in range(3):  # mean + std * N(0, 1) per channel (clamping barely matters at these values)
        values = out[:, c][erased[:, c]]
        assert abs(values.mean().item() - IMAGENET_MEAN[c]) < 0.01
        assert abs(values.std().item() - IMAGENET_STD[c]) < 0.015


# ----------------------------------------------------------------------------------------- BatchAugment
def test_heavy_scheme_soft_targets():
    np.random.seed(0)  # timm's Mixup draws from NumPy
    num_classes, smoothing = 10, 0.1
    augment = BatchAugment("heavy", num_classes, label_smoothing=smoothing)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(8)
    seen_mixed = False
    for seed in range(6):
        x, targets = augment(images, labels, generator=torch.Generator().manual_seed(seed))
        assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1
        assert targets.shape == (8, num_classes)
        torch.testing.assert_close(targets.sum(1), torch.ones(8))
        # timm: off = smoothing / C, on = 1 - smoothing + off; classes outside the pair keep exactly `off`.
        off = smoothing / num_classes
        assert torch.allclose(targets.min(1).values, torch.full((8,), off))
        assert targets.max() <= 1 - smoothing + off + 1e-6
        # batch mode mixes image i with image B - 1 - i: the mass is on those two labels
        pair = targets.gather(1, torch.stack([labels, labels.flip(0)], 1)).sum(1)
        torch.testing.assert_close(pair, torch.full((8,), 1 - smoothing + 2 * off))
        seen_mixed |= bool((targets.max(1).values < 1 - smoothing + off - 1e-4).any())
    assert seen_mixed


def test_heavy_scheme_odd_batch_keeps_every_sample():
    np.random.seed(1)
    num_classes, smoothing = 5, 0.1
    augment = BatchAugment("heavy", num_classes, flip=False, rand_augment="", erase_prob=0)  # mixing only
    images = torch.rand(7, 3, 16, 16)
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 3])
    x, targets = augment(images, labels)
    assert x.shape == images.shape and targets.shape == (7, num_classes)
    assert torch.equal(x[6], images[6])  # the odd one out passes unmixed
    expected = torch.full((num_classes,), smoothing / num_classes)
    expected[3] += 1 - smoothing
    torch.testing.assert_close(targets[6], expected)
    torch.testing.assert_close(targets.sum(1), torch.ones(7))
    x1, t1 = augment(images[:1], labels[:1])
    assert torch.equal(x1, images[:1]) and torch.allclose(t1[0], torch.tensor([0.92, 0.02, 0.02, 0.02, 0.02]))


@pytest.mark.parametrize("scheme", ["basic", "3aug", "deit3"])
def test_basic_and_3aug_keep_int_labels(scheme):
    images = torch.from_numpy(np.stack(smooth_images(n=32, seed=4))).permute(0, 3, 1, 2).contiguous()
    labels = torch.randint(0, 1000, (32,))
    augment = BatchAugment(scheme, 1000)
    x, y = augment(images, labels, generator=torch.Generator().manual_seed(0))
    assert torch.equal(y, labels) and y.dtype == torch.int64
    assert x.shape == images.shape and x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1
    # uint8 and [0, 1] float input agree; the caller's float tensor is not modified
    as_float = images.float() / 255
    before = as_float.clone()
    x_float, _ = augment(as_float, labels, generator=torch.Generator().manual_seed(0))
    assert torch.equal(as_float, before) and torch.allclose(x_float, x)
    reference = images.float() / 255
    flipped = [torch.equal(o, r.flip(-1)) for o, r in zip(x, reference)]
    if scheme == "basic":  # every image is itself or its mirror image, both occur
        assert all(torch.equal(o, r) or f for o, r, f in zip(x, reference, flipped))
        assert 5 < sum(flipped) < 27
    else:  # colour jitter (and 3-Augment) changes every image, differently for identical inputs
        assert not any(torch.equal(o, r) or f for o, r, f in zip(x, reference, flipped))
        same = images[:1].expand(16, -1, -1, -1)
        out, _ = augment(same, labels[:16], generator=torch.Generator().manual_seed(1))
        assert len({o.sum().item() for o in out}) > 8


def test_color_jitter_draws_per_sample():
    factors, order = ColorJitter(0.3, 0.3, 0.3).sample_params(6000, torch.Generator().manual_seed(0))
    assert ((factors >= 0.7) & (factors <= 1.3)).all()
    assert (factors.mean(0) - 1).abs().max() < 0.01 and (factors.std(0) - 0.6 / 12**0.5).abs().max() < 0.01
    permutations = torch.unique(order, dim=0, return_counts=True)[1]
    assert len(permutations) == 6 and (abs(permutations - 1000) < 120).all()  # every order, equally often


def test_three_augment_choices_are_per_sample():
    choice, sigma = ThreeAugment().sample_params(9000, torch.Generator().manual_seed(0))
    counts = torch.bincount(choice, minlength=3)
    assert (abs(counts - 3000) < 200).all()
    assert sigma.min() >= 0.1 and sigma.max() <= 2.0


def test_batch_augment_is_deterministic_with_a_generator():
    images = torch.randint(0, 256, (6, 3, 24, 24), dtype=torch.uint8)
    labels = torch.arange(6)
    for scheme in ("basic", "3aug", "deit3", "heavy"):
        augment = BatchAugment(scheme, 10, mix=False)
        a, _ = augment(images, labels, generator=torch.Generator().manual_seed(7))
        b, _ = augment(images, labels, generator=torch.Generator().manual_seed(7))
        c, _ = augment(images, labels, generator=torch.Generator().manual_seed(8))
        assert torch.equal(a, b) and not torch.equal(a, c), scheme


def test_unknown_scheme_names_the_choices():
    with pytest.raises(ValueError, match="'strong'.*basic, 3aug, deit3, heavy"):
        BatchAugment("strong", 10)


# --------------------------------------------------------------------- the device path (nothing read back)
DEVICE_PATH_SCHEMES = [
    ("basic", {}),
    ("3aug", {}),
    ("deit3", {}),
    ("deit3", {"mix": True}),
    ("heavy", {}),
    ("heavy", {"mix": False}),
    ("heavy", {"augmentation_fill": "official"}),
    ("heavy", {"augmentation_fill": "official", "mix": False, "erase_mode": "rand"}),
]


@pytest.mark.parametrize("scheme,options", DEVICE_PATH_SCHEMES)
@pytest.mark.parametrize("batch_size", [16, 15])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_batch_augment_device_path_reads_nothing_and_matches_the_cpu_path(
    monkeypatch, scheme, options, batch_size, dtype
):
    images = torch.from_numpy(np.stack(smooth_images(n=batch_size, seed=8))).permute(0, 3, 1, 2).contiguous()
    images = images if dtype == torch.uint8 else images.float() / 255
    labels = torch.arange(batch_size) % 10
    augment = BatchAugment(scheme, 10, **options)

    def run():
        return augment(images, labels, generator=torch.Generator().manual_seed(3), mix_rng=np.random.RandomState(4))

    with HostReads() as cpu_path:
        expected = run()
    # the CPU path sorts samples by the op they drew, reading the group sizes back (flip and colour jitter are
    # elementwise: nothing to group)
    assert bool(cpu_path.calls) == (scheme not in ("basic", "3aug")), cpu_path.listing()
    force_device_path(monkeypatch)
    with HostReads() as device_path:
        result = run()
    assert device_path.calls == [], device_path.listing()
    for ours, theirs in zip(result, expected):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_rand_augment_device_path_matches_the_cpu_path_for_every_op(monkeypatch):
    augment = RandAugment(prob=0.9)
    batch = to_batch(smooth_images(n=64, size=24, seed=9))
    params = augment.sample_params(len(batch), torch.Generator().manual_seed(2))
    drawn = params["op"][params["applied"]]
    assert set(drawn.tolist()) == set(range(len(RAND_AUGMENT_OPS)))  # every op occurs
    assert not params["applied"].all()  # and some samples pass a layer unchanged
    expected = augment.apply(batch, params)
    force_device_path(monkeypatch)
    with HostReads() as device_path:
        result = augment.apply(batch, params)
    assert device_path.calls == [], device_path.listing()
    assert torch.equal(result, expected)


# ------------------------------------------------------------------- MixUp/CutMix from an explicit stream
def timm_mixup(options: dict) -> Mixup:
    return Mixup(mode="batch", label_smoothing=0.1, num_classes=10, **options)


MIX_OPTIONS = [
    {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 0.5},  # BatchAugment's defaults
    {"mixup_alpha": 0.8, "cutmix_alpha": 0.0},
    {"mixup_alpha": 0.0, "cutmix_alpha": 1.0},
]


@pytest.mark.parametrize("options", MIX_OPTIONS)
@pytest.mark.parametrize("shape", [(8, 3, 32, 32), (2, 3, 17, 29), (6, 1, 224, 160)])
def test_mixing_matches_timm_mixup(options, shape):
    labels = torch.arange(shape[0]) % 10
    ours = MixUpCutMix(label_smoothing=0.1, num_classes=10, **options)
    boxes = 0
    for k in range(16):
        images = torch.rand(shape, generator=torch.Generator().manual_seed(k))
        np.random.seed(k)
        expected = timm_mixup(options)(images.clone(), labels)
        result = ours(images.clone(), labels, np.random.RandomState(k))
        for mine, theirs in zip(result, expected):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), k
        boxes += ours.sample(shape[-2], shape[-1], np.random.RandomState(k))[1] is not None
    if options["cutmix_alpha"] == 0:
        assert boxes == 0
    elif options["mixup_alpha"] == 0:
        assert boxes == 16
    else:
        assert 0 < boxes < 16  # both MixUp and CutMix batches


@pytest.mark.parametrize("batch_size", [8, 7])
def test_batch_augment_mixing_matches_timm_mixup(batch_size):
    augment = BatchAugment("heavy", 10, flip=False, rand_augment="", erase_prob=0)  # mixing only
    labels = torch.arange(batch_size) % 10
    even = batch_size - batch_size % 2
    for k in range(8):
        images = torch.rand((batch_size, 3, 20, 24), generator=torch.Generator().manual_seed(k))
        x, targets = augment(images, labels, mix_rng=np.random.RandomState(k))
        np.random.seed(k)
        expected_x, expected_targets = timm_mixup(MIX_OPTIONS[0])(images[:even].clone(), labels[:even])
        assert torch.equal(x[:even], expected_x) and torch.equal(targets[:even], expected_targets)
        assert torch.equal(x[even:], images[even:])  # the odd one out passes unmixed


def test_mix_rng_streams_are_their_own():
    augment = BatchAugment("heavy", 10, flip=False, rand_augment="", erase_prob=0)
    images, labels = torch.rand(8, 3, 16, 16), torch.arange(8)  # the targets give away lam

    def targets(seed: int) -> list[torch.Tensor]:
        np.random.seed(0)  # the global generator, seeded alike (as on every DDP rank), is not what draws
        before = np.random.get_state()
        rng = np.random.RandomState(seed)
        drawn = [augment(images, labels, mix_rng=rng)[1] for _ in range(4)]
        after = np.random.get_state()
        assert np.array_equal(after[1], before[1]) and after[2] == before[2]
        return drawn

    first, again, other = targets(1), targets(1), targets(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert any(not torch.equal(a, b) for a, b in zip(first, other))
    # without mix_rng the draws are timm's, from NumPy's global generator
    np.random.seed(1)
    assert torch.equal(augment(images, labels)[1], first[0])


def test_batch_augment_describes_its_mixing():
    text = repr(BatchAugment("heavy", 10))
    assert "mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1" in text
    assert "mixup_alpha" not in repr(BatchAugment("heavy", 10, mix=False))
    with pytest.raises(ValueError, match="mixup_alpha > 0 or cutmix_alpha > 0"):
        BatchAugment("heavy", 10, mixup_alpha=0, cutmix_alpha=0)


# ----------------------------------------------------------------------------------------- spec parsing
def test_parse_rand_augment_variants():
    assert parse_rand_augment("rand-m9-mstd0.5-inc1") == dict(
        num_ops=2, magnitude=9.0, magnitude_std=0.5, magnitude_max=10.0, prob=0.5
    )
    assert parse_rand_augment("rand-inc1") == dict(  # timm's defaults
        num_ops=2, magnitude=10.0, magnitude_std=0.0, magnitude_max=10.0, prob=0.5
    )
    parsed = parse_rand_augment("rand-m7-n3-p0.7-mmax9-mstd101-inc1")
    assert parsed == dict(num_ops=3, magnitude=7.0, magnitude_std=math.inf, magnitude_max=9.0, prob=0.7)
    augment = RandAugment.from_spec("rand-m7-n3-p0.7-mmax9-mstd0.5-inc1")
    # timm reads the same spec the same way, and uses the same op set
    reference = timm_aa.rand_augment_transform("rand-m7-n3-p0.7-mmax9-mstd0.5-inc1", {"img_mean": (0, 0, 0)})
    assert reference.num_layers == augment.num_ops == 3
    assert tuple(op.name for op in reference.ops) == RAND_AUGMENT_OPS
    op = reference.ops[0]
    assert (op.prob, op.magnitude, op.magnitude_std, op.magnitude_max) == (
        augment.prob,
        augment.magnitude,
        augment.magnitude_std,
        augment.magnitude_max,
    )


@pytest.mark.parametrize(
    "spec",
    [
        "rand-m9-mstd0.5",  # timm's non-increasing default op set
        "rand-m9-inc0",
        "rand-m9-inc1-tweights",  # another op set
        "augmix-m5-inc1",
        "rand-m9-inc1-x5",  # unknown section
        "rand-mfoo-inc1",
        "rand-m9-n-inc1",
    ],
)
def test_parse_rand_augment_rejects_unsupported(spec):
    with pytest.raises(ValueError, match="RandAugment spec"):
        parse_rand_augment(spec)


# --------------------------------------------------------------- fill and noise: ImageNet defaults vs official
@pytest.mark.parametrize(
    "fill_name,expected", [("imagenet", [round(255 * v) for v in IMAGENET_MEAN]), ("official", [0, 0, 0])]
)
def test_rand_augment_fill_colour(monkeypatch, fill_name, expected):
    augment = BatchAugment("heavy", 10, augmentation_fill=fill_name)
    batch = to_batch(smooth_images(n=2, seed=7))
    ours = to_uint8(augment.rand_augment.apply_op(batch, "TranslateXRel", 9.0, 1.0))
    # timm's own op on PIL with the img_mean its transform factory derives from the transform's mean
    monkeypatch.setattr(timm_aa, "_randomly_negate", lambda v: v)
    op = timm_aa.AugmentOp(
        "TranslateXRel", prob=1.0, magnitude=9.0, hparams={"img_mean": tuple(expected), "interpolation": Image.BICUBIC}
    )
    reference = np.stack([np.asarray(op(Image.fromarray(a))) for a in smooth_images(n=2, seed=7)]).astype(np.int64)
    assert np.abs(ours - reference).max() <= 1
    # a shift by 0.405 of the width (13 px) samples beyond the right edge: the right-most columns are fill
    assert (ours[:, :, -12:] == np.array(expected)).all() and not (ours[:, :, :19] == np.array(expected)).all()


def test_official_erasing_noise_is_unclamped_standard_normal():
    augment = BatchAugment(
        "heavy", 10, augmentation_fill="official", rand_augment="", erase_prob=1.0, mix=False, flip=False
    )
    out, _ = augment(
        torch.full((64, 3, 32, 32), 0.5), torch.zeros(64, dtype=torch.long), generator=torch.Generator().manual_seed(0)
    )
    noise = out[out != 0.5]
    assert noise.numel() > 10000
    # timm's _get_pixels: N(0, 1) in the normalised space, which mean 0 / std 1 makes the [0, 1] space
    assert abs(noise.mean().item()) < 0.02 and abs(noise.std().item() - 1) < 0.02
    assert (noise < 0).float().mean() > 0.45 and (noise > 1).float().mean() > 0.13  # P(N > 1) = 0.159
    for c in range(3):
        values = out[:, c][out[:, c] != 0.5]
        assert abs(values.mean().item()) < 0.03 and abs(values.std().item() - 1) < 0.03


def test_default_fill_and_noise_stay_timm_imagenet_defaults():
    augment = BatchAugment("heavy", 10, rand_augment="", erase_prob=1.0, mix=False, flip=False)
    assert augment.rand_augment is None and augment.erasing.clamp
    assert BatchAugment("heavy", 10).rand_augment.fill.tolist() == [round(255 * v) for v in IMAGENET_MEAN]
    out, _ = augment(
        torch.full((64, 3, 32, 32), 0.5), torch.zeros(64, dtype=torch.long), generator=torch.Generator().manual_seed(0)
    )
    assert out.min() >= 0 and out.max() <= 1
    for c in range(3):
        values = out[:, c][out[:, c] != 0.5]
        assert abs(values.mean().item() - IMAGENET_MEAN[c]) < 0.01
        assert abs(values.std().item() - IMAGENET_STD[c]) < 0.015


def test_unknown_fill_names_the_choices():
    with pytest.raises(ValueError, match="imagenet, official"):
        BatchAugment("heavy", 10, augmentation_fill="grey")


# ------------------------------------------------------------------ the options in the data pipeline
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from robust_lightning.data.sources import SyntheticSource

    synthetic = SyntheticSource(
        num_classes=4, train_per_class=8, val_per_class=4, image_size=40, root=str(tmp_path_factory.mktemp("synthetic"))
    )
    return {"source": synthetic, "image_size": 32, "batch_size": 8, "num_workers": 0}


def training_batch(data: dict, **options) -> tuple[dict, object]:
    from robust_lightning.data.datamodule import ImageNetDataModule

    dm = ImageNetDataModule(**data, **options)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    dm.trainer = type("T", (), {"training": True})()
    return batch, dm


def test_official_noise_reaches_the_batch_on_both_paths(tiny_data):
    for augment_on in ("device", "cpu"):
        torch.manual_seed(0)
        raw, dm = training_batch(tiny_data, augmentation="heavy", augment_on=augment_on, augmentation_fill="official")
        assert raw["image"].dtype == torch.uint8
        assert dm.training_augmentation.device.erasing is not None and not dm.training_augmentation.device.erasing.clamp
        if augment_on == "cpu":  # the workers erase nothing: their uint8 could not hold the noise
            assert (
                dm.training_augmentation.worker.erasing is None
                and dm.training_augmentation.worker.rand_augment.fill.sum() == 0
            )
        images = torch.cat([dm.on_after_batch_transfer(dict(raw), 0)["image"] for _ in range(8)])
        assert images.min() < 0 and images.max() > 1


def test_full_resolution_decode_crops_in_the_workers(tiny_data):
    batch, dm = training_batch(tiny_data, full_resolution_decode=True)
    assert "geometry" not in batch and batch["image"].shape == (8, 3, 32, 32)
    conditions = dm.conditions()
    assert conditions["full_resolution_decode"] and "canvas_size" not in conditions
    assert not any("reduced scale" in d for d in conditions["differences_from_official_code"])
    batch, dm = training_batch(tiny_data)
    assert "geometry" in batch and dm.conditions()["full_resolution_decode"] is False
    assert any("reduced scale" in d for d in dm.conditions()["differences_from_official_code"])


def test_results_list_the_differences_from_the_official_code(tiny_data):
    from robust_lightning.data.datamodule import ImageNetDataModule
    from robust_lightning.training.lightning_module import ImageClassifier

    def data_differences(**options) -> str:
        dm = ImageNetDataModule(**tiny_data, augmentation="heavy", **options)
        dm.prepare_data()
        dm.setup("fit")
        return " | ".join(dm.conditions()["differences_from_official_code"])

    default = data_differences()
    assert "ImageNet mean colour" in default and "reduced scale" in default and "global_batch_size" not in default
    official = data_differences(augmentation_fill="official", full_resolution_decode=True, global_batch_size=8)
    assert "ImageNet mean colour" not in official and "reduced scale" not in official
    assert "global_batch_size" in official
    assert "reproduced" in official  # RandAugment still runs on the device
    assert "reproduced" not in data_differences(augment_on="cpu")
    assert "CutMix box of timm 1.0.31" in default  # 1 px longer on odd sides than the official code's timm

    def model_differences(**options) -> str:
        return " | ".join(
            ImageClassifier(arch="test_resnet", num_classes=4, **options).conditions()["differences_from_official_code"]
        )

    timm_rule = model_differences(select_attack_steps=1)
    assert "weight decay: timm's rule" in timm_rule and "lr schedule" in timm_rule and "selection" in timm_rule
    official = model_differences(weight_decay_rule="official")
    assert "weight decay" not in official and "selection" not in official


def test_recipes_use_the_official_fill_and_decode():
    from pathlib import Path

    from robust_lightning.argument_parsing import compose_config

    recipes = sorted((Path(__file__).resolve().parents[1] / "configs" / "recipes").glob("*.yaml"))
    assert len(recipes) > 10
    for path in recipes:
        text = path.read_text()
        data = compose_config(path)["data"]  # with the bases it extends
        assert data["augmentation_fill"] == "official" and data["full_resolution_decode"] is True, path.name
        assert "timm's ImageNet defaults" not in text.split("seed_everything")[0], path.name  # header up to date


def test_3aug_is_flip_then_colour_jitter_0_4_and_deit3_keeps_3_augment():
    """Singh et al.'s 3-Aug (App. D.2: basic + flip + colour jitter), with the light recipe's ColorJitter(0.4):
    the same draws give exactly flip, then ColorJitter(0.4) on the flipped batch."""
    images = torch.from_numpy(np.stack(smooth_images(n=8, seed=2))).permute(0, 3, 1, 2).contiguous()
    labels = torch.arange(8)
    out, _ = BatchAugment("3aug", 10)(images, labels, generator=torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(5)
    x = images.float() / 255
    flip = (torch.rand(8, generator=generator) < 0.5).view(-1, 1, 1, 1)
    x = torch.where(flip, x.flip(-1), x)
    expected = ColorJitter(0.4, 0.4, 0.4)(x, generator)
    assert torch.equal(out, expected)
    assert BatchAugment("3aug", 10).three_augment is None and BatchAugment("deit3", 10).three_augment is not None
    assert BatchAugment("deit3", 10).three_augment.color_jitter.ranges == (0.3, 0.3, 0.3)
