"""Batched, per-sample training augmentation on the accelerator side of the pipeline.

The CPU side decodes, random-resized-crops and ships uint8 batches (see ``transforms.py``); everything
else the training recipes ask for happens here, on whole batches, with its own random draw per sample:

* ``RandAugment``   - timm's ``rand-m9-mstd0.5-inc1`` (Singh, Croce & Hein), op choice and magnitude per image.
* ``RandomErasing`` - timm's random erasing, one box per erased image.
* ``ColorJitter``   - torchvision's ColorJitter(b, c, s) per image; after a flip it is scheme '3aug', Singh et al.'s
  3-Aug (App. D.2: basic + random horizontal flip + colour jitter), not DeiT III's 3-Augment.
* ``ThreeAugment``  - DeiT III's 3-Augment (grayscale | solarize | blur, then ColorJitter): scheme 'deit3'.
* ``MixUpCutMix``   - timm's MixUp/CutMix of a whole batch, drawing from an explicit random stream.
* ``BatchAugment``  - the named schemes 'basic', '3aug', 'deit3' and 'heavy', with MixUp/CutMix for 'heavy'.

The reference pipelines run these ops on PIL images, so they are reproduced with Pillow's 8-bit
arithmetic: images are processed on the 0..255 scale, every op that yields uint8 in Pillow rounds or
truncates as Pillow does (results sit on the 1/255 grid), geometric ops use Pillow's transform filters,
fill rule and coordinate convention.  Colour ops, 3-Augment and ColorJitter match Pillow bit for bit;
bilinear/bicubic geometric ops to within 1/255 on rare pixels (tests/test_augment.py).

Per-sample choices are vectorised.  On the CPU, samples are sorted by the op they drew and each op runs
once on its contiguous slice of the batch (reading the slice sizes back costs nothing there).  On other
devices such a read would make the host wait for the device's queue, so every op of a layer runs on the
whole batch and torch.where keeps each sample's own result: fixed shapes, nothing read back, bit for bit
the same result (every op works per sample).  Per-sample draws come from an optional torch.Generator on the
images' device; MixUp/CutMix's per-batch draws from a NumPy-style random stream on the host.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict

import numpy as np
import torch
import torch.nn.functional as F
from timm.data.mixup import mixup_target  # unannotated in timm: its two calls ignore no-untyped-call
from torch import Tensor

from robust_lightning.devices import host_reads_are_cheap

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# timm's increasing RandAugment set (_RAND_INCREASING_TRANSFORMS), in timm's order.
RAND_AUGMENT_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "SolarizeAdd",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
GEOMETRIC_OPS = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
SCHEMES = ("basic", "3aug", "deit3", "heavy")
# Colour jitter strength per scheme. '3aug': an assumption. Singh et al. (App. D.2) describe 3-Aug as basic + random
# horizontal flip + colour jitter after Debenedetti et al.'s light recipe and name no strength; their code
# (github.com/nmndeep/revisiting-at, parserr.py) has no 3-Aug setting (its heavy recipe's color_jitter 0.4 does
# nothing, as timm skips the jitter when RandAugment is on). 0.4 is the light recipe's, in
# github.com/dedeswim/vits-robustness-torch, configs/xcit-adv-training.yaml from commit 57a3109 (January 2022) on:
# aa None, hflip 0.5, color_jitter 0.4, timm's ColorJitter(0.4, 0.4, 0.4); the file's earlier versions hold a heavy
# recipe in which the same 0.4 is inert. 'deit3': DeiT III's 3-Augment with its --color-jitter default 0.3
# (github.com/facebookresearch/deit, augment.py new_data_aug_generator and main.py).
COLOR_JITTER = {"3aug": 0.4, "deit3": 0.3}


class AugmentationFill(TypedDict):
    """RandAugment's fill colour (``mean``) and RandomErasing's noise (``mean``, ``std``, ``clamp``)."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    clamp: bool


# RandAugment's fill colour and RandomErasing's noise (data.augmentation_fill), as timm derives them from the
# mean/std its transform is built with.  'imagenet': timm's ImageNet defaults (fill = the mean colour, noise
# mean + std * N(0, 1), clamped to [0, 1] here).  'official': Singh et al.'s code builds timm's transform with
# mean 0 / std 1 (github.com/nmndeep/revisiting-at, dataset_convnext_like.py), so its fill is black and its
# erasing noise N(0, 1) per pixel and channel in [0, 1] space, never clamped (timm's _get_pixels).
AUGMENTATION_FILLS: dict[str, AugmentationFill] = {
    "imagenet": {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "clamp": True},
    "official": {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), "clamp": False},
}
_MOVES = {"Rotate": "xy", "ShearX": "x", "TranslateXRel": "x", "ShearY": "y", "TranslateYRel": "y"}

_LEVEL_DENOM = 10.0  # timm: magnitude M maps to the fraction M / 10 of each op's range
_ROTATE_MAX_DEG = 30.0
_SHEAR_MAX = 0.3
_TRANSLATE_PCT = 0.45
_ENHANCE_MAX = 0.9  # enhance factors 1 +- 0.9 * M / 10, floored at 0.1

# ITU-R 601-2 luma in Pillow's 16-bit fixed point (RGB -> "L" conversion, rounded).
_LUMA_FIXED = (19595.0, 38470.0, 7471.0)


# ----------------------------------------------------------------------------------------------- helpers
def _sample_view(values: Tensor) -> Tensor:
    """(n,) per-sample parameters -> (n, 1, 1, 1), broadcastable over (n, C, H, W)."""
    return values.view(-1, 1, 1, 1)


def _device_copy(t: Tensor, device: torch.device | str | None) -> Tensor:
    """t on `device`.  Module buffers stay on the host unless the module is moved; a blocking host-to-device
    copy synchronises the stream (the host waits for the device's queue), a non-blocking one need not and is
    safe from pageable memory too (the driver stages the data before returning)."""
    return t.to(device, non_blocking=True)


def _apply_grouped(x: Tensor, group: Tensor, num_groups: int, fn: Callable[[int, Tensor, Tensor], Tensor]) -> Tensor:
    """out[rows] = fn(g, rows, x[rows]) for each group g < num_groups; samples with group == num_groups pass.

    `fn` must work per sample (a sample's result depends on its own image and parameters only): the two
    dispatches below then give the same result bit for bit.
    """
    if not host_reads_are_cheap(group):
        # Fixed shapes: every group runs on the whole batch and each sample keeps its own group's result.
        rows = torch.arange(x.shape[0], device=x.device)
        out = x
        for g in range(num_groups):
            out = torch.where(_sample_view(group == g), fn(g, rows, x), out)
        return out
    # Sorting by group makes every group a contiguous run of indices, so however many groups there are the
    # dispatch reads back once (the group sizes) instead of once per group.
    order = torch.argsort(group, stable=True)
    sizes = torch.bincount(group, minlength=num_groups + 1).tolist()
    out = x.clone()
    start = 0
    for g, size in enumerate(sizes[:num_groups]):
        if size:
            rows = order[start : start + size]
            out[rows] = fn(g, rows, x[rows])
        start += size
    return out


def _double(values: Tensor) -> Tensor:
    """Op arguments in double precision, as timm computes them in Python (MPS has no float64)."""
    return values.to(torch.float32 if values.device.type == "mps" else torch.float64)


def _to_unit_float(images: Tensor) -> Tensor:
    """uint8 -> float32 / 255; float -> a float32 copy (callers' tensors are never modified in place)."""
    if images.dtype == torch.uint8:
        return images.float().div_(255)
    if not images.is_floating_point():
        raise TypeError(f"expected uint8 or floating-point images, got {images.dtype}")
    return images.to(torch.float32, copy=True)


def _check_batch(images: Tensor, floating: bool = True) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected an RGB batch (B, 3, H, W), got shape {tuple(images.shape)}")
    if floating and not images.is_floating_point():
        raise TypeError(f"expected float images in [0, 1], got {images.dtype}")


# ------------------------------------------------------------------------- PIL-exact ops on 0..255 floats
# All functions below take integer-valued float tensors (n, 3, H, W) in [0, 255] and return the same.


def _grayscale(x: Tensor) -> Tensor:
    """Pillow's RGB -> L: (19595 R + 38470 G + 7471 B + 2^15) >> 16; exact in float32 (sums < 2^24)."""
    # Python-number weights (no host-to-device copy); integer products and sums < 2^24: exact in any order.
    r, g, b = torch.split(x, 1, dim=1)
    return torch.floor((r * _LUMA_FIXED[0] + g * _LUMA_FIXED[1] + b * _LUMA_FIXED[2] + 32768.0) / 65536.0)


def _blend(degenerate: Tensor, x: Tensor, factor: Tensor) -> Tensor:
    """Image.blend(degenerate, x, factor) (all ImageEnhance ops): computed in float32, truncated, clipped."""
    f = _sample_view(factor.float())
    return torch.floor(degenerate + f * (x - degenerate)).clamp_(0, 255)


def _autocontrast(x: Tensor) -> Tensor:
    """ImageOps.autocontrast: stretch each channel's [min, max] to [0, 255]; constant channels unchanged."""
    n, c, h, w = x.shape
    values = x.reshape(n * c, h * w).long()
    lo = values.amin(1, keepdim=True)
    hi = values.amax(1, keepdim=True)
    # Pillow builds a LUT int(i * scale - lo * scale) in double precision, which often lands just below the
    # exact integer; the same double arithmetic on a per-channel LUT reproduces it bit for bit.
    span = _double((hi - lo).clamp(min=1))
    scale = torch.full_like(span, 255.0) / span  # not 255.0 / span: torch evaluates that as 255 * (1 / span)
    i = torch.arange(256, device=x.device, dtype=span.dtype)
    lut = torch.trunc(i * scale + (-_double(lo) * scale)).clamp_(0, 255).long()
    lut = torch.where(hi > lo, lut, torch.arange(256, device=x.device))
    return lut.gather(1, values).view(n, c, h, w).to(x.dtype)


def _equalize(x: Tensor) -> Tensor:
    """ImageOps.equalize per sample and channel, via a 256-bin histogram per (sample, channel)."""
    n, c, h, w = x.shape
    values = x.reshape(n * c, h * w).long()
    # A fixed-size histogram (bincount's output size would be read back from the device)
    ones = torch.ones((), dtype=torch.long, device=x.device).expand_as(values)
    hist = torch.zeros((n * c, 256), dtype=torch.long, device=x.device).scatter_add_(1, values, ones)
    # Pillow: step = (count of all pixels but those of the highest present value) // 255; the LUT maps
    # value i to (step // 2 + #pixels below i) // step; step == 0 (<= 1 distinct value, ...) -> identity.
    top_count = hist.gather(1, values.amax(1, keepdim=True))
    step = (h * w - top_count) // 255
    below = hist.cumsum(1) - hist
    lut = ((step // 2 + below) // step.clamp(min=1)).clamp_(max=255)
    lut = torch.where(step > 0, lut, torch.arange(256, device=x.device))
    return lut.gather(1, values).view(n, c, h, w).to(x.dtype)


def _posterize(x: Tensor, bits: Tensor) -> Tensor:
    """ImageOps.posterize: keep the top `bits` bits (<= 0 bits -> black, >= 8 bits -> unchanged)."""
    quantum = _sample_view(torch.exp2(8 - bits.clamp(0, 8).float()))
    return torch.floor(x / quantum) * quantum


def _solarize(x: Tensor, threshold: Tensor | float) -> Tensor:
    """ImageOps.solarize: invert values >= threshold."""
    if isinstance(threshold, Tensor):
        threshold = _sample_view(threshold.float())
    return torch.where(x < threshold, x, 255 - x)


def _solarize_add(x: Tensor, add: Tensor, threshold: float = 128) -> Tensor:
    """timm solarize_add: values below the threshold get `add` added (clipped at 255)."""
    return torch.where(x < threshold, (x + _sample_view(add.float())).clamp_(max=255), x)


def _contrast_degenerate(x: Tensor) -> Tensor:
    """ImageEnhance.Contrast blends with a flat image at the rounded mean of the grayscale image."""
    mean = _double(_grayscale(x)).mean(dim=(2, 3), keepdim=True)  # ImageStat's mean is a double
    return torch.floor(mean + 0.5).to(x.dtype).expand_as(x)


def _smooth(x: Tensor) -> Tensor:
    """ImageFilter.SMOOTH ([[1,1,1],[1,5,1],[1,1,1]] / 13, rounded); Pillow leaves the 1-pixel border as is."""
    # 3x3 box sum (two separable passes of shifted slices) + 4 x centre: exact integer sums in float32.
    rows = x[..., :, :-2] + x[..., :, 1:-1] + x[..., :, 2:]
    total = rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :] + 4 * x[..., 1:-1, 1:-1]
    out = x.clone()
    out[..., 1:-1, 1:-1] = torch.floor(total / 13 + 0.5)
    return out


def _gaussian_blur(x: Tensor, radius: Tensor, max_radius: float, passes: int = 3) -> Tensor:
    """ImageFilter.GaussianBlur(radius) per sample: Pillow's three extended box blurs along x, then along y.

    Each pass is a box of fractional radius r = l + a (Pillow's _gaussian_blur_radius, in C floats) whose
    2l + 1 inner taps weigh ww = int(2^24 / (2r + 1)) and the two outer taps fw = (2^24 - (2l + 1) ww) / 2
    (8.24 fixed point), with edge pixels replicated and every pass rounded to 8 bits: Pillow's result bit
    for bit.
    """
    n, _c, _h, _w = x.shape
    sigma2 = radius.float() ** 2 / passes
    inner = torch.floor((torch.sqrt(12 * sigma2 + 1) - 1) / 2)  # l
    frac = (2 * inner + 1) * (inner * (inner + 1) - 3 * sigma2) / (6 * (sigma2 - (inner + 1) ** 2))  # a
    ww = torch.floor(2.0**24 / ((inner + frac) * 2 + 1))
    fw = torch.floor((2.0**24 - (2 * inner + 1) * ww) / 2)
    # One tap range (the widest box any radius <= max_radius needs) serves every sample; taps beyond a
    # sample's own box weigh 0.
    half = int((math.sqrt(12 * max_radius**2 / passes + 1) - 1) // 2) + 1
    offsets = torch.arange(-half, half + 1, device=x.device).abs()
    weights = torch.where(offsets <= inner[:, None], ww[:, None], 0.0)
    weights = torch.where(offsets == inner[:, None] + 1, fw[:, None], weights)
    weights = _double(weights[:, half:].T.reshape(half + 1, n, 1, 1, 1))  # symmetric: offsets 0..half
    y = _double(x)  # the fixed-point sums stay below 2^32: exact in double precision
    for dim, pad in ((3, (half, half, 0, 0)), (2, (0, 0, half, half))):  # along the width, then the height
        size = y.shape[dim]
        for _ in range(passes):
            padded = F.pad(y, pad, mode="replicate")
            bulk = padded.narrow(dim, half, size) * weights[0]
            for k in range(1, half + 1):
                bulk += (padded.narrow(dim, half - k, size) + padded.narrow(dim, half + k, size)) * weights[k]
            y = torch.floor((bulk + 2.0**23) / 2.0**24)  # (bulk + 2^23) >> 24
    return y.to(x.dtype)


def _resampling_taps(coord: Tensor, interpolation: str) -> tuple[Tensor, list[Tensor]]:
    """First tap index and tap weights of Pillow's transform filters along one axis (Geometry.c).

    `coord` is continuous with pixel centres at +0.5.  Nearest takes pixel floor(coord) (Pillow computes
    rotations/shears with nearest in 16.16 fixed point, so exact ties on pixel boundaries may resolve to the
    neighbour there); bilinear and bicubic interpolate between centres, bicubic with the a = -1 cubic
    convolution kernel of Pillow's transform (sharper than torch's a = -0.75 bicubic and Pillow's own
    a = -0.5 resize filter).
    """
    if interpolation == "nearest":
        return torch.floor(coord), [torch.ones_like(coord)]
    base = torch.floor(coord - 0.5)
    d = coord - 0.5 - base
    if interpolation == "bilinear":
        return base, [1 - d, d]
    d2, d3 = d * d, d * d * d
    return base - 1, [-d + 2 * d2 - d3, 1 - 2 * d2 + d3, d + d2 - d3, d3 - d2]


def _affine(x: Tensor, matrices: Tensor, fill: Tensor, interpolation: tuple[str, str]) -> Tensor:
    """Image.transform(size, AFFINE, data, resample, fillcolor) for a batch of per-sample matrices.

    `matrices` (n, 2, 3) are PIL's AFFINE data: output pixel centre (x + 0.5, y + 0.5) samples the input
    at matrix @ (x + 0.5, y + 0.5, 1).  Like Pillow, source points outside the image get the fill colour,
    the filter replicates edge pixels otherwise, and the result is truncated to 8 bits.  `interpolation`
    names the filter along x and along y: ops that keep rows (or columns) in place pass 'nearest' for that
    axis, which is exact there and needs a quarter of the taps.  The taps are gathered directly because
    grid_sample has no a = -1 bicubic kernel.
    """
    n, c, h, w = x.shape
    # Source coordinates in double precision like Pillow's: shifts and shears often land exactly on pixel
    # boundaries, where float32 rounding would truncate differently.
    m = _double(matrices).view(n, 6, 1).unbind(1)
    ys, xs = torch.meshgrid(
        torch.arange(h, device=x.device, dtype=m[0].dtype) + 0.5,
        torch.arange(w, device=x.device, dtype=m[0].dtype) + 0.5,
        indexing="ij",
    )
    xs, ys = xs.reshape(1, h * w), ys.reshape(1, h * w)
    src_x = m[0] * xs + m[1] * ys + m[2]  # (n, h * w)
    src_y = m[3] * xs + m[4] * ys + m[5]
    x0, weights_x = _resampling_taps(src_x, interpolation[0])
    y0, weights_y = _resampling_taps(src_y, interpolation[1])
    # Channels-last rows: one gathered index fetches all channels of a pixel.
    pixels = x.permute(0, 2, 3, 1).reshape(n * h * w, c)
    first = torch.arange(n, device=x.device).view(n, 1) * (h * w)
    out: Tensor | float = 0.0
    for j, wy in enumerate(weights_y):
        row = first + (y0 + j).clamp(0, h - 1).long() * w
        line: Tensor | float = 0.0
        for k, wx in enumerate(weights_x):
            taps = pixels[(row + (x0 + k).clamp(0, w - 1).long()).view(-1)].view(n, h * w, c)
            line = line + wx.to(x.dtype).unsqueeze(-1) * taps
        out = out + wy.to(x.dtype).unsqueeze(-1) * line
    inside = ((src_x >= 0) & (src_x < w) & (src_y >= 0) & (src_y < h)).unsqueeze(-1)
    assert isinstance(out, Tensor)  # the taps summed: weights_y is never empty
    out = torch.where(inside, torch.floor(out), fill.to(x.dtype))
    return out.clamp_(0, 255).view(n, h, w, c).permute(0, 3, 1, 2)


# ------------------------------------------------------------------------------------------ RandAugment
class RandAugmentOptions(TypedDict):
    """RandAugment's options that a timm spec sets (``parse_rand_augment``)."""

    num_ops: int
    magnitude: float
    magnitude_std: float
    magnitude_max: float
    prob: float


def parse_rand_augment(spec: str) -> RandAugmentOptions:
    """Parse a timm RandAugment spec ('rand-m9-mstd0.5-inc1', '-n2', '-p0.5', '-mmax9') into RandAugment kwargs.

    Sections and defaults follow timm.data.auto_augment.rand_augment_transform: m = magnitude (10),
    n = ops per image (2), p = probability of applying each op (0.5), mstd = magnitude std (0; > 100 means
    uniform in [0, m]), mmax = magnitude clip (10).  Only timm's increasing op set is implemented, so the
    spec must contain 'inc1'; other op sets ('t...', 'inc0', no 'inc') raise ValueError, as do unknown sections.
    """
    sections = spec.split("-")
    if sections[0] != "rand":
        raise ValueError(f"RandAugment spec must start with 'rand', got {spec!r}")
    kwargs = RandAugmentOptions(
        num_ops=2, magnitude=_LEVEL_DENOM, magnitude_std=0.0, magnitude_max=_LEVEL_DENOM, prob=0.5
    )
    increasing = False
    for section in sections[1:]:
        if section.startswith("t"):  # timm: 't<name>' selects another op set
            raise ValueError(f"RandAugment spec {spec!r}: op set {section[1:]!r} is not supported")
        key = section.rstrip("0123456789.")
        value = section[len(key) :]
        try:
            if key == "m":
                kwargs["magnitude"] = float(value)
            elif key == "n":
                kwargs["num_ops"] = int(value)
            elif key == "p":
                kwargs["prob"] = float(value)
            elif key == "mstd":
                std = float(value)
                kwargs["magnitude_std"] = math.inf if std > 100 else std  # timm: > 100 means uniform
            elif key == "mmax":
                kwargs["magnitude_max"] = float(value)
            elif key == "inc":
                increasing = bool(int(value))
            else:
                raise KeyError(section)
        except (KeyError, ValueError):
            raise ValueError(f"RandAugment spec {spec!r}: cannot parse section {section!r}") from None
    if not increasing:
        raise ValueError(f"RandAugment spec {spec!r}: only timm's increasing op set ('inc1') is supported")
    return kwargs


class RandAugment(torch.nn.Module):
    fill: Tensor  # buffers (__init__)
    _group_of_op: Tensor
    """Per-sample RandAugment on float [0, 1] batches, semantics of timm 'rand-m9-mstd0.5-inc1' (timm 1.0.31).

    For every image, `num_ops` times: an op is drawn uniformly (with replacement) from timm's increasing
    set (RAND_AUGMENT_OPS), applied with probability `prob`, at a magnitude drawn from N(magnitude,
    magnitude_std) (uniform in [0, magnitude] if the std is inf) clipped to [0, magnitude_max]; signed ops
    (Rotate, Shear*, Translate*Rel, the four *Increasing enhancements) flip sign with probability 0.5.
    All draws are independent per image and per op application.

    Op arguments at magnitude M (timm's level functions): Rotate +-30 M/10 deg about the centre; ShearX/Y
    +-0.3 M/10; TranslateX/YRel +-0.45 M/10 of the width/height; PosterizeIncreasing keeps 4 - int(4 M/10)
    bits; SolarizeIncreasing threshold 256 - min(256, int(256 M/10)); SolarizeAdd adds min(128, int(110 M/10))
    below 128; Color/Contrast/Brightness/Sharpness factor max(0.1, 1 +- 0.9 M/10).

    Geometric ops fill with `fill` (RGB in [0, 1], converted like timm's img_mean: min(255, round(255 v)))
    and resample with `interpolation` as Pillow's Image.transform does ('bicubic' is Pillow's a = -1 cubic):
    timm passes the training interpolation when it is not 'random' - bicubic in the Singh et al. recipe -
    and picks bilinear or bicubic at random per op otherwise ('random' is not offered here).
    Images are rounded to the 8-bit grid on entry and results stay on it, as with PIL.

    One deliberate difference: at M = 10 (2.3 % of PosterizeIncreasing draws with mstd 0.5) timm asks for
    0 bits; older Pillow returns black, the installed Pillow 13 raises ValueError.  Black is returned here.
    """

    def __init__(
        self,
        num_ops: int = 2,
        magnitude: float = 9.0,
        magnitude_std: float = 0.5,
        magnitude_max: float = 10.0,
        prob: float = 0.5,
        fill: Sequence[float] = IMAGENET_MEAN,
        interpolation: str = "bicubic",
    ):
        super().__init__()
        if len(fill) != 3:
            raise ValueError(f"fill must be an RGB triple, got {fill!r}")
        if interpolation not in ("nearest", "bilinear", "bicubic"):
            raise ValueError(f"interpolation must be 'nearest', 'bilinear' or 'bicubic', got {interpolation!r}")
        self.num_ops, self.magnitude, self.magnitude_std = num_ops, float(magnitude), float(magnitude_std)
        self.magnitude_max, self.prob, self.interpolation = float(magnitude_max), float(prob), interpolation
        fill255 = [min(255, round(255 * v)) for v in fill]
        self.register_buffer("fill", torch.tensor(fill255, dtype=torch.float32), persistent=False)
        # Geometric ops share resampling passes with per-sample matrices: Rotate (2-D filter), the ops that
        # only move pixels along rows (grouped under ShearX) and those that move them along columns (ShearY).
        # Groups are named by their first op; every group can occur (the device path runs each of them).
        joins = {"TranslateXRel": "ShearX", "TranslateYRel": "ShearY"}
        self._groups = tuple(op for op in RAND_AUGMENT_OPS if op not in joins)
        group = [self._groups.index(joins.get(op, op)) for op in RAND_AUGMENT_OPS]
        self.register_buffer("_group_of_op", torch.tensor(group), persistent=False)

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> "RandAugment":
        return cls(**parse_rand_augment(spec), **kwargs)

    def extra_repr(self) -> str:
        return (
            f"num_ops={self.num_ops}, magnitude={self.magnitude}, magnitude_std={self.magnitude_std}, "
            f"magnitude_max={self.magnitude_max}, prob={self.prob}, fill={self.fill.tolist()}, "
            f"interpolation={self.interpolation!r}"
        )

    def sample_magnitudes(
        self, shape: tuple[int, ...], generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> Tensor:
        """Magnitudes as timm draws them: N(M, std) (U(0, M) for an infinite std), clipped to [0, mmax]."""
        if self.magnitude_std == math.inf:
            m = torch.rand(shape, generator=generator, device=device) * self.magnitude
        elif self.magnitude_std > 0:
            m = torch.randn(shape, generator=generator, device=device) * self.magnitude_std + self.magnitude
        else:
            m = torch.full(shape, self.magnitude, device=device)
        return m.clamp(0.0, self.magnitude_max)

    def sample_params(
        self, n: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> dict[str, Tensor]:
        """All draws for a batch of n images, each (num_ops, n): 'op' (index into RAND_AUGMENT_OPS), 'applied'
        (bool, probability `prob`), 'magnitude' (clipped) and 'sign' (+-1, used by the signed ops only)."""
        shape = (self.num_ops, n)
        return {
            "op": torch.randint(len(RAND_AUGMENT_OPS), shape, generator=generator, device=device),
            "applied": torch.rand(shape, generator=generator, device=device) < self.prob,
            "magnitude": self.sample_magnitudes(shape, generator, device),
            "sign": torch.where(torch.rand(shape, generator=generator, device=device) < 0.5, -1.0, 1.0),
        }

    def forward(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """float (B, 3, H, W) in [0, 1] -> augmented, same shape/dtype/device; `generator` lives on that device."""
        _check_batch(images)
        return self.apply(images, self.sample_params(images.shape[0], generator, images.device))

    # the op on given draws; not nn.Module.apply(fn), which this name hides
    def apply(self, images: Tensor, params: dict[str, Tensor]) -> Tensor:  # type: ignore[override]
        """Apply the draws of `sample_params` (op layers in order; each layer dispatches per sample)."""
        _check_batch(images)
        x = torch.round(images.float() * 255).clamp_(0, 255)
        for layer in zip(params["op"], params["applied"], params["magnitude"], params["sign"]):
            x = self._layer(x, *layer)
        return (x / 255).to(images.dtype)

    def _layer(self, x: Tensor, op: Tensor, applied: Tensor, magnitude: Tensor, sign: Tensor) -> Tensor:
        """One op per sample: each op group (see __init__) runs on the samples that drew one of its ops."""
        not_applied = len(self._groups)

        def run(g: int, rows: Tensor, xs: Tensor) -> Tensor:
            name = self._groups[g]
            if name in GEOMETRIC_OPS:
                return self._geometric(xs, op[rows], magnitude[rows], sign[rows], _MOVES[name])
            return self._colour(xs, name, magnitude[rows], sign[rows])

        # buffers stay put when this module is used without being moved to the images' device
        group = torch.where(applied, _device_copy(self._group_of_op, op.device)[op], not_applied)
        return _apply_grouped(x, group, not_applied, run)

    def apply_op(self, images: Tensor, name: str, magnitude: float | Tensor, sign: float | Tensor = 1.0) -> Tensor:
        """Apply one named op to every image at a given (already clipped) magnitude and sign."""
        if name not in RAND_AUGMENT_OPS:
            raise ValueError(f"unknown op {name!r}; available: {', '.join(RAND_AUGMENT_OPS)}")
        n, device = images.shape[0], images.device
        params = {
            "op": torch.full((1, n), RAND_AUGMENT_OPS.index(name), device=device),
            "applied": torch.ones((1, n), dtype=torch.bool, device=device),
            # double, like timm's Python floats, so that e.g. M = 7.3 gives the same op arguments
            "magnitude": _double(torch.as_tensor(magnitude, device=device)).expand(1, n),
            "sign": _double(torch.as_tensor(sign, device=device)).expand(1, n),
        }
        return self.apply(images, params)

    @staticmethod
    def _colour(x: Tensor, name: str, m: Tensor, sign: Tensor) -> Tensor:
        level, sign = _double(m) / _LEVEL_DENOM, _double(sign)
        if name == "AutoContrast":
            return _autocontrast(x)
        if name == "Equalize":
            return _equalize(x)
        if name == "Invert":
            return 255 - x
        if name == "PosterizeIncreasing":
            return _posterize(x, 4 - torch.floor(level * 4))
        if name == "SolarizeIncreasing":
            return _solarize(x, 256 - torch.floor(level * 256).clamp(max=256))
        if name == "SolarizeAdd":
            return _solarize_add(x, torch.floor(level * 110).clamp(max=128))
        factor = (1.0 + sign * level * _ENHANCE_MAX).clamp(min=0.1)
        if name == "ColorIncreasing":
            return _blend(_grayscale(x).expand_as(x), x, factor)
        if name == "ContrastIncreasing":
            return _blend(_contrast_degenerate(x), x, factor)
        if name == "BrightnessIncreasing":
            return _blend(torch.zeros_like(x), x, factor)
        if name == "SharpnessIncreasing":
            return _blend(_smooth(x), x, factor)
        raise AssertionError(f"unhandled op {name}")

    def _geometric(self, x: Tensor, op: Tensor, m: Tensor, sign: Tensor, moves: str = "xy") -> Tensor:
        """Geometric ops of a group of samples in one resampling pass, via per-sample PIL AFFINE matrices.

        `moves` says along which axes the group's ops move pixels ('x', 'y' or 'xy'); the other axis keeps
        source points on pixel centres, so a single tap reproduces Pillow's filter there.
        """
        n, _, h, w = x.shape
        level = _double(sign) * _double(m) / _LEVEL_DENOM
        index = {name: RAND_AUGMENT_OPS.index(name) for name in GEOMETRIC_OPS}
        shear, translate = level * _SHEAR_MAX, level * _TRANSLATE_PCT
        zeros = torch.zeros_like(level)

        def pick(name: str, value: Tensor) -> Tensor:
            return torch.where(op == index[name], value, zeros)

        # PIL Image.rotate(deg) (counter-clockwise on screen) samples the input at R(deg) (x - c) + c with
        # R = [[cos, -sin], [sin, cos]] in image coordinates (y down), c = (w / 2, h / 2).
        angle = torch.deg2rad(pick("Rotate", level * _ROTATE_MAX_DEG))
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = cos, -sin + pick("ShearX", shear)
        d, e = sin + pick("ShearY", shear), cos
        # Rotation keeps the centre fixed; translations are in pixels of the output size.
        cx, cy = w / 2.0, h / 2.0
        is_rot = op == index["Rotate"]
        c = torch.where(is_rot, cx - cos * cx + sin * cy, pick("TranslateXRel", translate * w))
        f = torch.where(is_rot, cy - sin * cx - cos * cy, pick("TranslateYRel", translate * h))
        matrices = torch.stack([a, b, c, d, e, f], dim=1).view(n, 2, 3)
        interpolation = (
            self.interpolation if "x" in moves else "nearest",
            self.interpolation if "y" in moves else "nearest",
        )
        return _affine(x, matrices, _device_copy(self.fill, x.device), interpolation)


# ---------------------------------------------------------------------------------------- RandomErasing
class RandomErasing(torch.nn.Module):
    mean: Tensor  # buffers (__init__)
    std: Tensor
    """Per-sample random erasing with timm's semantics (timm.data.RandomErasing, max_count=1), vectorised.

    Each image is erased with probability `probability`: up to 10 attempts draw an area fraction
    U(min_area, max_area) and a log-uniform aspect ratio in [min_aspect, max_aspect] (default 1/min_aspect),
    h = round(sqrt(area * aspect)), w = round(sqrt(area / aspect)); the first attempt with h < H and w < W
    is placed uniformly and erased (if none fits, the image is left alone).

    timm erases normalised images; ours are in [0, 1], so its fills are mapped back through mean/std:
    'pixel' = per-pixel N(0, 1) -> mean + std * noise, 'rand' = one N(0, 1) colour per box, 'const' = 0 ->
    the mean colour; results are clamped to [0, 1] unless `clamp` is False (timm itself never clamps: with
    mean 0 / std 1, as Singh et al.'s code builds it, the noise is N(0, 1) in [0, 1] space).
    """

    MODES = ("pixel", "rand", "const")

    def __init__(
        self,
        probability: float = 0.25,
        min_area: float = 0.02,
        max_area: float = 1 / 3,
        min_aspect: float = 0.3,
        max_aspect: float | None = None,
        mode: str = "pixel",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        attempts: int = 10,
        clamp: bool = True,
    ):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"unknown erasing mode {mode!r}; available: {', '.join(self.MODES)}")
        self.probability, self.min_area, self.max_area, self.mode = probability, min_area, max_area, mode
        self.log_aspect = (math.log(min_aspect), math.log(max_aspect or 1 / min_aspect))
        self.attempts, self.clamp = attempts, clamp
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def extra_repr(self) -> str:
        return (
            f"probability={self.probability}, area=({self.min_area}, {self.max_area:.4f}), mode={self.mode!r}, "
            f"mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()}, clamp={self.clamp}"
        )

    def boxes(
        self,
        n: int,
        height: int,
        width: int,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """(n, 4) int boxes (top, left, h, w) per image; h = w = 0 where the image is not erased."""
        shape = (n, self.attempts)
        area = torch.rand(shape, generator=generator, device=device) * (self.max_area - self.min_area) + self.min_area
        area = area * (height * width)
        lo, hi = self.log_aspect
        aspect = torch.exp(torch.rand(shape, generator=generator, device=device) * (hi - lo) + lo)
        h = torch.round(torch.sqrt(area * aspect))
        w = torch.round(torch.sqrt(area / aspect))
        fits = (h < height) & (w < width)
        first = fits.float().argmax(1, keepdim=True)  # first fitting attempt (0 if none fits)
        h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
        erase = (torch.rand(n, generator=generator, device=device) < self.probability) & fits.any(1)
        h, w = torch.where(erase, h, 0), torch.where(erase, w, 0)
        # top ~ randint(0, H - h) inclusive, left likewise
        top = torch.floor(torch.rand(n, generator=generator, device=device) * (height - h + 1))
        left = torch.floor(torch.rand(n, generator=generator, device=device) * (width - w + 1))
        return torch.stack([top, left, h, w], dim=1).long()

    def forward(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """float (B, 3, H, W) in [0, 1] -> a new tensor with the erased boxes filled (outside [0, 1] there
        only when `clamp` is False)."""
        _check_batch(images)
        n, c, height, width = images.shape
        top, left, h, w = self.boxes(n, height, width, generator, images.device).unbind(1)
        rows = torch.arange(height, device=images.device).view(1, height, 1)
        cols = torch.arange(width, device=images.device).view(1, 1, width)
        inside = (
            (rows >= top.view(-1, 1, 1))
            & (rows < (top + h).view(-1, 1, 1))
            & (cols >= left.view(-1, 1, 1))
            & (cols < (left + w).view(-1, 1, 1))
        ).unsqueeze(1)
        if self.mode == "pixel":
            noise = torch.randn(images.shape, generator=generator, device=images.device)
        elif self.mode == "rand":
            noise = torch.randn((n, c, 1, 1), generator=generator, device=images.device)
        else:
            noise = torch.zeros((1, c, 1, 1), device=images.device)
        mean, std = _device_copy(self.mean, images.device), _device_copy(self.std, images.device)
        fill = mean + std * noise
        fill = (fill.clamp_(0, 1) if self.clamp else fill).to(images.dtype)
        return torch.where(inside, fill, images)


# ----------------------------------------------------------------------------------------- 3-Augment
class ColorJitter(torch.nn.Module):
    """torchvision ColorJitter(brightness, contrast, saturation) on PIL images, per sample on a batch.

    Each image draws factors U(1 - v, 1 + v) and applies brightness, contrast and saturation in its own
    random order; each step is Pillow's ImageEnhance blend (8-bit, truncated), as torchvision does on PIL.
    Works on float [0, 1] batches; images are rounded to the 8-bit grid on entry.
    """

    OPS = ("brightness", "contrast", "saturation")

    def __init__(self, brightness: float = 0.3, contrast: float = 0.3, saturation: float = 0.3):
        super().__init__()
        self.ranges = (brightness, contrast, saturation)

    def extra_repr(self) -> str:
        return "brightness={}, contrast={}, saturation={}".format(*self.ranges)

    def sample_params(
        self, n: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """factors (n, 3) for OPS, each U(max(0, 1 - v), 1 + v); order (n, 3), a random permutation per image."""
        u = torch.rand((n, 3), generator=generator, device=device)
        lo = _device_copy(torch.tensor([max(0.0, 1 - v) for v in self.ranges]), device)
        hi = _device_copy(torch.tensor([1 + v for v in self.ranges]), device)
        order = torch.argsort(torch.rand((n, 3), generator=generator, device=device), dim=1)
        return lo + (hi - lo) * u, order

    def forward(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        _check_batch(images)
        return self.apply(images, *self.sample_params(images.shape[0], generator, images.device))

    # the op on given draws; not nn.Module.apply(fn), which this name hides
    def apply(self, images: Tensor, factors: Tensor, order: Tensor) -> Tensor:  # type: ignore[override]
        _check_batch(images)
        x = torch.round(images.float() * 255).clamp_(0, 255)
        degenerates: tuple[Callable[[Tensor], Tensor], ...] = (
            torch.zeros_like,
            _contrast_degenerate,
            lambda y: _grayscale(y).expand_as(y),
        )
        # Step k applies to each image the op in position k of its order (factor 1 leaves an image exact);
        # evaluating every op on the whole batch is cheap elementwise work and needs no host sync.
        for k in range(3):
            for j, degenerate in enumerate(degenerates):
                if self.ranges[j] > 0:
                    x = _blend(degenerate(x), x, torch.where(order[:, k] == j, factors[:, j], 1.0))
        return (x / 255).to(images.dtype)


class ThreeAugment(torch.nn.Module):
    """DeiT III's 3-Augment, per sample: one of grayscale, solarize (threshold 128) or PIL's Gaussian blur
    (radius U(0.1, 2.0)) drawn uniformly per image, followed by ColorJitter(`color_jitter` x 3)."""

    CHOICES = ("grayscale", "solarize", "blur")

    def __init__(self, color_jitter: float | None = 0.3, blur_sigma: tuple[float, float] = (0.1, 2.0)):
        super().__init__()
        self.blur_sigma = blur_sigma
        self.color_jitter = ColorJitter(color_jitter, color_jitter, color_jitter) if color_jitter else None

    def sample_params(
        self, n: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """choice (n,) index into CHOICES; sigma (n,) blur radius (used where the choice is 'blur')."""
        choice = torch.randint(3, (n,), generator=generator, device=device)
        lo, hi = self.blur_sigma
        return choice, torch.rand(n, generator=generator, device=device) * (hi - lo) + lo

    def forward(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        _check_batch(images)
        x = self.apply(images, *self.sample_params(images.shape[0], generator, images.device))
        return self.color_jitter(x, generator) if self.color_jitter is not None else x

    # the op on given draws; not nn.Module.apply(fn), which this name hides
    def apply(self, images: Tensor, choice: Tensor, sigma: Tensor) -> Tensor:  # type: ignore[override]
        """The grayscale / solarize / blur step for given draws (no colour jitter)."""
        _check_batch(images)
        x = torch.round(images.float() * 255).clamp_(0, 255)

        def run(g: int, rows: Tensor, xs: Tensor) -> Tensor:
            if self.CHOICES[g] == "grayscale":
                return _grayscale(xs).expand_as(xs)
            if self.CHOICES[g] == "solarize":
                return _solarize(xs, 128.0)
            return _gaussian_blur(xs, sigma[rows], self.blur_sigma[1])

        return (_apply_grouped(x, choice, 3, run) / 255).to(images.dtype)


# ------------------------------------------------------------------------------------------ MixUp/CutMix
class MixRandom(Protocol):
    """The per-batch draws of MixUp/CutMix: a NumPy RandomState, or NumPy's global one (the module np.random)."""

    def rand(self) -> float: ...

    def beta(self, a: float, b: float) -> float: ...

    def randint(self, low: int, high: int) -> int: ...


class MixUpCutMix:
    """MixUp or CutMix of a whole batch with the semantics of timm's Mixup(mode="batch") (timm.data.mixup:
    prob 1, correct_lam=True, no cutmix_minmax), its per-batch draws taken from an explicit random stream.

    timm draws from NumPy's global generator, which every DDP rank seeds alike.  Here `rng` is anything with
    NumPy's legacy methods rand(), beta(a, b) and randint(low, high): a numpy.random.RandomState, or the
    module numpy.random itself (the default), with which the draws - and so the results - are timm's.
    Per batch (Mixup._params_per_batch): CutMix with probability `switch_prob` when both alphas are > 0
    (only the mode whose alpha is > 0 otherwise), lam ~ Beta(alpha, alpha) of that mode.  MixUp blends image
    i with image B - 1 - i; CutMix pastes a box of image B - 1 - i into image i (rand_bbox: sides
    sqrt(1 - lam) of the image's, centre uniform, clipped to the image) and lam becomes the share of the
    image left uncovered (cutmix_bbox_and_lam).  Targets are timm's mixup_target (label smoothing included).

    The box is that of the timm pinned here (1.0.31: cut_h // 2 rows above the centre, (cut_h + 1) // 2 below, so
    cut_h rows in all; likewise for columns).  The timm of Singh et al.'s code (0.8.0.dev0,
    github.com/nmndeep/revisiting-at README), as timm up to 1.0.28, cut cut_h // 2 on both sides: its box is 1 px
    shorter along each side of odd length (before clipping), and lam follows the box.  A difference from the
    official code; the random draws are the same.
    """

    def __init__(
        self,
        mixup_alpha: float = 0.8,
        cutmix_alpha: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
    ):
        if not (mixup_alpha > 0 or cutmix_alpha > 0):
            raise ValueError(
                f"MixUp/CutMix needs mixup_alpha > 0 or cutmix_alpha > 0, got {mixup_alpha}, {cutmix_alpha}"
            )
        self.mixup_alpha, self.cutmix_alpha, self.switch_prob = mixup_alpha, cutmix_alpha, switch_prob
        self.label_smoothing, self.num_classes = label_smoothing, num_classes

    def sample(
        self, height: int, width: int, rng: np.random.RandomState | None = None
    ) -> tuple[float, tuple[int, int, int, int] | None]:
        """lam and the CutMix box (top, bottom, left, right) as Python numbers (None: MixUp), drawn in timm's
        order: Mixup._params_per_batch, then (CutMix with lam < 1 only) rand_bbox's centre row and column."""
        draws: MixRandom = np.random if rng is None else rng
        draws.rand()  # timm's draw against prob (1 here: always mixes), kept to stay on timm's stream
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            use_cutmix = draws.rand() < self.switch_prob
        else:
            use_cutmix = self.cutmix_alpha > 0
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = float(draws.beta(alpha, alpha))
        if not use_cutmix or lam == 1.0:  # timm's _mix_batch draws no box for lam == 1
            return lam, None
        ratio = math.sqrt(1 - lam)
        cut_h, cut_w = int(height * ratio), int(width * ratio)
        cy, cx = int(draws.randint(0, height)), int(draws.randint(0, width))
        top, bottom = max(cy - cut_h // 2, 0), min(cy + (cut_h + 1) // 2, height)
        left, right = max(cx - cut_w // 2, 0), min(cx + (cut_w + 1) // 2, width)
        return 1.0 - (bottom - top) * (right - left) / float(height * width), (top, bottom, left, right)

    def __call__(self, x: Tensor, labels: Tensor, rng: np.random.RandomState | None = None) -> tuple[Tensor, Tensor]:
        """Mixes the (even) batch `x` in place and returns it with the soft targets (B, num_classes)."""
        if x.shape[0] % 2:
            raise ValueError(f"MixUp/CutMix pairs image i with image B - 1 - i: needs an even batch, got {x.shape[0]}")
        lam, box = self.sample(x.shape[-2], x.shape[-1], rng)
        if box is not None:
            top, bottom, left, right = box  # Python ints: slicing reads nothing back from the device
            x[..., top:bottom, left:right] = x[..., top:bottom, left:right].flip(0)
        elif lam != 1.0:
            flipped = x.flip(0).mul_(1.0 - lam)  # timm's arithmetic: x * lam + flipped x * (1 - lam)
            x.mul_(lam).add_(flipped)
        return x, mixup_target(labels, self.num_classes, lam, self.label_smoothing)  # type: ignore[no-untyped-call]


# ---------------------------------------------------------------------------------------- BatchAugment
class BatchAugment(torch.nn.Module):
    """The device side of a named augmentation scheme (the random-resized crop happens on the CPU side).

    Takes a uint8 or float (B, 3, H, W) batch and int labels (B,); returns (float images in [0, 1] but for
    erased boxes under 'official', targets): the int labels unless mixing is on, then soft targets
    (B, num_classes) as timm's Mixup gives them (label smoothing included: off-class mass smoothing /
    num_classes, true class 1 - smoothing + that).

    Schemes:
      'basic' - horizontal flip only.
      '3aug'  - flip and ColorJitter(0.4, 0.4, 0.4): Singh et al.'s 3-Aug (App. D.2: basic + random horizontal
                flip + colour jitter), not DeiT III's 3-Augment; the strength 0.4 is Debenedetti et al.'s, which
                Singh et al. do not state (see COLOR_JITTER).
      'deit3' - flip, DeiT III 3-Augment (grayscale | solarize | blur) and ColorJitter(0.3, 0.3, 0.3).
      'heavy' - flip, RandAugment `rand_augment`, RandomErasing(`erase_prob`, 'pixel'), then MixUp
                (`mixup_alpha`) / CutMix (`cutmix_alpha`), switching with `switch_prob`, per batch as timm.
    `mix` forces mixing on/off (default: on for 'heavy' only); without mixing the labels stay int and label
    smoothing is the loss's business.  `color_jitter` is the jitter strength of '3aug' / 'deit3' (default:
    COLOR_JITTER), `augmentation_fill`
    the RandAugment fill colour and RandomErasing noise (AUGMENTATION_FILLS: 'imagenet' = timm's ImageNet
    defaults, 'official' = Singh et al.'s black fill and unclamped N(0, 1) noise, which leaves erased pixels
    outside [0, 1]) and `erase_mode` the RandomErasing mode; `rand_augment=""` / `erase_prob=0` turn those
    steps off; `flip=False` leaves flipping to the CPU side.

    Per-sample draws use `generator` (on the images' device) when given; MixUp/CutMix (MixUpCutMix) draws
    from `mix_rng`, by default NumPy's global generator as timm's Mixup.  Mixing needs an even batch: with an
    odd batch the first B - 1 images are mixed and the last one passes through unmixed, with the
    label-smoothed one-hot target an unmixed timm sample gets.  Nothing is read back from the device on
    devices where that would make the host wait (see _apply_grouped).
    """

    def __init__(
        self,
        scheme: str,
        num_classes: int,
        *,
        flip: bool = True,
        rand_augment: str = "rand-m9-mstd0.5-inc1",
        erase_prob: float = 0.25,
        mixup_alpha: float = 0.8,
        cutmix_alpha: float = 1.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.1,
        mix: bool | None = None,
        color_jitter: float | None = None,
        augmentation_fill: str = "imagenet",
        erase_mode: str = "pixel",
    ):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"unknown augmentation scheme {scheme!r}; available: {', '.join(SCHEMES)}")
        if augmentation_fill not in AUGMENTATION_FILLS:
            raise ValueError(
                f"unknown augmentation fill {augmentation_fill!r}; available: {', '.join(AUGMENTATION_FILLS)}"
            )
        self.scheme, self.num_classes, self.flip = scheme, num_classes, flip
        self.augmentation_fill = augmentation_fill
        fill = AUGMENTATION_FILLS[augmentation_fill]
        heavy = scheme == "heavy"
        self.rand_augment = RandAugment.from_spec(rand_augment, fill=fill["mean"]) if heavy and rand_augment else None
        self.erasing = RandomErasing(erase_prob, mode=erase_mode, **fill) if heavy and erase_prob > 0 else None
        jitter = COLOR_JITTER.get(scheme) if color_jitter is None else color_jitter
        self.three_augment = ThreeAugment(jitter) if scheme == "deit3" else None
        self.color_jitter = ColorJitter(jitter, jitter, jitter) if scheme == "3aug" and jitter else None
        mix = scheme == "heavy" if mix is None else mix
        self.mixup = MixUpCutMix(mixup_alpha, cutmix_alpha, switch_prob, label_smoothing, num_classes) if mix else None

    def extra_repr(self) -> str:
        mix = ""
        if self.mixup is not None:
            m = self.mixup
            mix = (
                f", mixup_alpha={m.mixup_alpha}, cutmix_alpha={m.cutmix_alpha}, switch_prob={m.switch_prob}, "
                f"label_smoothing={m.label_smoothing}"
            )
        return (
            f"scheme={self.scheme!r}, num_classes={self.num_classes}, flip={self.flip}, "
            f"augmentation_fill={self.augmentation_fill!r}{mix}"
        )

    def forward(
        self,
        images: Tensor,
        labels: Tensor,
        generator: torch.Generator | None = None,
        mix_rng: np.random.RandomState | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`generator` (on the images' device) feeds the per-sample draws, `mix_rng` MixUp/CutMix's per-batch
        draws (see MixUpCutMix; default NumPy's global generator, as timm)."""
        _check_batch(images, floating=False)
        x = _to_unit_float(images)
        if self.flip:
            flip = _sample_view(torch.rand(x.shape[0], generator=generator, device=x.device) < 0.5)
            x = torch.where(flip, x.flip(-1), x)
        if self.three_augment is not None:
            x = self.three_augment(x, generator)
        if self.color_jitter is not None:
            x = self.color_jitter(x, generator)
        if self.rand_augment is not None:
            x = self.rand_augment(x, generator)
        if self.erasing is not None:
            x = self.erasing(x, generator)
        if self.mixup is None:
            return x, labels
        return self._mix(x, labels, mix_rng)

    def _mix(self, x: Tensor, labels: Tensor, rng: np.random.RandomState | None) -> tuple[Tensor, Tensor]:
        assert self.mixup is not None  # called with mixing on
        n = x.shape[0]
        if n % 2 == 0:
            return self.mixup(x, labels, rng)  # mixes x in place (x is this module's own tensor)
        # lam = 1: the odd one out gets the smoothed one-hot target of an unmixed timm sample.
        smoothing = self.mixup.label_smoothing
        last = mixup_target(labels[n - 1 :], self.num_classes, 1.0, smoothing)  # type: ignore[no-untyped-call]
        if n == 1:
            return x, last
        _, targets = self.mixup(x[: n - 1], labels[: n - 1], rng)  # mixes that view of x in place
        return x, torch.cat([targets, last.to(targets.dtype)])
