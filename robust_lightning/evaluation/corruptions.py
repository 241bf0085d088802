"""The 19 ImageNet-C corruptions (Hendrycks & Dietterich, ICLR 2019), for generating the benchmark on the fly.

Our own implementation of ``ImageNet-C/create_c/make_imagenet_c.py`` (hendrycks/robustness), with its per-severity
parameters (data/imagenet_c_parameters.md), for an H x W x 3 uint8 image of any size (at least 32 px):
``corrupt(image, "fog", severity=3, rng=seed)`` returns an H x W x 3 uint8 image. The float result is converted
to uint8 by truncation, as the original did (``np.uint8(img)`` before saving).

Randomness comes only from the ``rng`` argument: a seed, a ``numpy.random.Generator`` (its bit generator is
used and advanced) or a ``numpy.random.RandomState``. The draws are taken through the legacy RandomState
methods, in the order of the original script, so ``rng=RandomState(s)`` reproduces the reference under
``np.random.seed(s)`` draw for draw (tests/test_corruptions.py shows it per corruption).

Where the ``imagecorruptions`` package (the usual reference, made for any image size) departs from the original
script, the original is followed and the function's docstring says so (pixelate, elastic_transform, frost at 224 px,
the centred trim of the zooms). Sizes other than 224 are handled the way ``imagecorruptions`` generalises:
parameters in pixels (noise, blur radii, motion lengths, JPEG quality) stay as published, the fog map grows to
the next power of two, the frost texture is scaled up when it is smaller than the image, and the elastic
transform scales with the image. So at 384 px a blur is milder relative to the image than at 224.

Two steps of the original ran in ImageMagick (Wand), which is not used here: the motion blur of motion_blur and
snow is the numpy port of ImageMagick's MotionBlurImage kernel that ``imagecorruptions`` uses (same kernel,
edge pixels repeated; ImageMagick's 16-bit intermediate and 8-bit PNG output are not reproduced).
"""

import hashlib
import math
from collections.abc import Callable
from functools import cache
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
from PIL import Image
from scipy.ndimage import map_coordinates
from scipy.ndimage import zoom as scipy_zoom
from skimage.color import hsv2rgb, rgb2hsv
from skimage.filters import gaussian

from robust_lightning.errors import UserError
from robust_lightning.paths import DATA_DIR

if TYPE_CHECKING:
    import torch

RNG = int | np.random.Generator | np.random.RandomState | None
MIN_SIZE = 32
RELEASED_JPEG_QUALITY = 85
FROST_FILES = ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg")  # frost6.jpg: never drawn

# Per-severity parameters of make_imagenet_c.py (data/imagenet_c_parameters.md has their meaning)
PARAMETERS: dict[str, Any] = {  # per corruption, a tuple of severities (numbers or tuples of them)
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "shot_noise": (60, 25, 12, 5, 3),
    "impulse_noise": (0.03, 0.06, 0.09, 0.17, 0.27),
    "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),
    "glass_blur": ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)),
    "motion_blur": ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15)),
    # zoom factors np.arange(1, stop, step): float rounding makes the stop itself part of the first one
    "zoom_blur": ((1.11, 0.01), (1.16, 0.01), (1.21, 0.02), (1.26, 0.02), (1.31, 0.03)),
    "snow": (
        (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
        (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
        (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
        (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
    ),
    "frost": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),
    "fog": ((1.5, 2), (2, 2), (2.5, 1.7), (2.5, 1.5), (3, 1.4)),
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    # (alpha, sigma, affine jitter) in units of 244 px at 224 px ("244 should have been 224" in the original)
    "elastic_transform": ((2, 0.7, 0.1), (2, 0.08, 0.2), (0.05, 0.01, 0.02), (0.07, 0.01, 0.02), (0.12, 0.01, 0.02)),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
    "jpeg_compression": (25, 18, 15, 10, 7),
    "speckle_noise": (0.15, 0.2, 0.35, 0.45, 0.6),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "spatter": (
        (0.65, 0.3, 4, 0.69, 0.6, 0),
        (0.65, 0.3, 3, 0.68, 0.6, 0),
        (0.65, 0.3, 2, 0.68, 0.5, 0),
        (0.65, 0.3, 1, 0.65, 1.5, 1),
        (0.67, 0.4, 1, 0.65, 1.5, 1),
    ),
    "saturate": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
}


# ----------------------------------------------------------------------------------------------- helpers
def random_state(rng: RNG) -> np.random.RandomState:
    """The legacy interface over ``rng``: a Generator's bit generator is shared (drawing advances it), an int
    seeds MT19937 as ``np.random.seed`` does."""
    if isinstance(rng, np.random.RandomState):
        return rng
    if isinstance(rng, np.random.Generator):
        return np.random.RandomState(rng.bit_generator)
    return np.random.RandomState(rng)


def _to_uint8(x: np.ndarray) -> np.ndarray:
    """[0, 255] floats to uint8 by truncation, as the original's ``np.uint8(img)`` before saving."""
    truncated: np.ndarray = np.clip(x, 0, 255).astype(np.uint8)
    return truncated


def _unit(image: np.ndarray) -> np.ndarray:
    unit: np.ndarray = image / 255.0  # float64 in [0, 1], the original's working scale
    return unit


def _gaussian(x: np.ndarray, sigma: float, **options: str | int) -> np.ndarray:
    """skimage's gaussian filter, which skimage leaves unannotated."""
    smoothed: np.ndarray = gaussian(x, sigma=sigma, **options)  # type: ignore[no-untyped-call]  # (docstring)
    return smoothed


def _blur(x: np.ndarray, sigma: float) -> np.ndarray:
    """skimage's gaussian over the two spatial axes (the original's ``multichannel=True``)."""
    return _gaussian(x, sigma, channel_axis=-1)


def _clipped_zoom(x: np.ndarray, factor: float) -> np.ndarray:
    """Zoom into the centre of an H x W x C array by ``factor`` (bilinear) and keep H x W.

    The crop of ceil(size / factor) is zoomed back to about the size; any extra rows or columns are trimmed on
    both sides (centred), as in the original. ``imagecorruptions`` trims at the bottom / right instead (for
    snow only after the motion blur); the two agree whenever the zoomed crop is at most one pixel too large,
    which is always the case for zoom_blur."""
    crop = []
    for size in x.shape[:2]:
        kept = int(np.ceil(size / float(factor)))
        crop.append(slice((size - kept) // 2, (size - kept) // 2 + kept))
    # channel by channel: the same values as one zoom by (factor, factor, 1), in less than half the time
    zoomed = np.stack([scipy_zoom(x[crop[0], crop[1], c], factor, order=1) for c in range(x.shape[2])], axis=-1)
    trim = [(zoomed.shape[axis] - x.shape[axis]) // 2 for axis in (0, 1)]
    return zoomed[trim[0] : trim[0] + x.shape[0], trim[1] : trim[1] + x.shape[1]]


def _motion_blur(x: np.ndarray, radius: int, sigma: float, angle: float) -> np.ndarray:
    """ImageMagick's MotionBlurImage as ported by ``imagecorruptions``: a one-sided Gaussian of 2 * radius + 1
    taps along ``angle`` (degrees), each tap the image shifted by the rounded offset, borders repeated.
    Works on H x W or H x W x C; returns float64."""
    width = 2 * radius + 1
    taps = np.arange(width)
    # the constant factor cancels in the normalisation but is kept: it decides how the weights round
    kernel = np.exp(-(taps**2) / (2 * sigma**2)) / (np.sqrt(2 * np.pi) * sigma)
    kernel = kernel / kernel.sum()
    point = (width * np.sin(np.deg2rad(angle)), width * np.cos(np.deg2rad(angle)))
    length = math.hypot(*point)
    rows, cols = np.arange(x.shape[0]), np.arange(x.shape[1])
    blurred = np.zeros(x.shape, dtype=np.float32)
    for i in range(width):
        dy = -math.ceil(i * point[0] / length - 0.5)
        dx = -math.ceil(i * point[1] / length - 0.5)
        if abs(dy) >= x.shape[0] or abs(dx) >= x.shape[1]:  # the motion left the image
            break
        shifted = x[np.clip(rows - dy, 0, x.shape[0] - 1)[:, None], np.clip(cols - dx, 0, x.shape[1] - 1)]
        blurred = blurred + kernel[i] * shifted  # accumulated in this order, like the reference (float64)
    return blurred


def _plasma_fractal(size: int, decay: float, rng: np.random.RandomState) -> np.ndarray:
    """A size x size diamond-square height map in [0, 1] (size a power of two; the map wraps around).

    Each level sets the centre of every square, then the midpoints of the square edges, to the mean of their
    4 neighbours plus uniform noise in +-wibble**2; wibble starts at 100 and is divided by ``decay`` per level.
    The draws are taken in the original's order: squares, then the diamonds on the corner rows, then those
    on the centre rows."""
    height = np.empty((size, size))
    height[0, 0] = 0
    step, wibble = size, 100.0

    def noisy_mean(total: np.ndarray) -> np.ndarray:
        return total / 4 + wibble * rng.uniform(-wibble, wibble, total.shape)

    while step >= 2:
        half = step // 2
        corners = height[0::step, 0::step]
        square = corners + np.roll(corners, -1, axis=0)
        square += np.roll(square, -1, axis=1)
        height[half::step, half::step] = noisy_mean(square)
        centres = height[half::step, half::step]
        # sums grouped in pairs as in the original, so they round the same
        height[0::step, half::step] = noisy_mean(
            (centres + np.roll(centres, 1, axis=0)) + (corners + np.roll(corners, -1, axis=1))
        )
        height[half::step, 0::step] = noisy_mean(
            (centres + np.roll(centres, 1, axis=1)) + (corners + np.roll(corners, -1, axis=0))
        )
        step //= 2
        wibble /= decay
    height -= height.min()
    normalised: np.ndarray = height / height.max()
    return normalised


def _shuffle_pixels(x: np.ndarray, delta: int, rng: np.random.RandomState) -> np.ndarray:
    """One pass of glass_blur's local pixel shuffle, vectorised with the original's sequential semantics.

    The original visits (h, w) for h from H - delta down to delta + 1 and, within a row, w from W - delta
    down to delta + 1, draws (dx, dy) = randint(-delta, delta, size=2) and runs
    ``x[h, w], x[h', w'] = x[h', w'], x[h, w]`` with (h', w') = (h + dy, w + dx). With numpy views that
    statement is a copy, not a swap: x[h, w] takes the *current* value of x[h', w'], and x[h', w'] is left
    as it is. So a visited pixel ends with the start-of-pass value of its source, unless the source was
    visited earlier in the pass; then it ends with whatever that source ended with, which is a chain.
    Here all draws are taken at once (the same stream as one randint call per pixel) and the chains are
    resolved by pointer doubling: O(HW log chain) array work instead of a Python loop over the pixels.
    """
    height, width = x.shape[:2]
    rows = np.arange(height - delta, delta, -1)
    cols = np.arange(width - delta, delta, -1)
    if not len(rows) or not len(cols):
        return x
    offsets = rng.randint(-delta, delta, size=(len(rows) * len(cols), 2))  # (dx, dy) per visited pixel
    h, w = np.repeat(rows, len(cols)), np.tile(cols, len(rows))
    visited = h * width + w  # flat index, in visiting order
    source = (h + offsets[:, 1]) * width + (w + offsets[:, 0])
    step = np.full(height * width, len(visited))  # when each pixel is visited (never: after the last)
    step[visited] = np.arange(len(visited))
    earlier = step[source] < step[visited]
    # after the pass, pixel p holds the start-of-pass value of pixel read[root[p]] (root: the chain's end)
    root = np.arange(height * width)
    root[visited] = np.where(earlier, source, visited)
    read = np.arange(height * width)
    read[visited] = source
    while True:  # chains strictly go back in visiting order, so this ends
        jumped = root[root]
        if np.array_equal(jumped, root):
            break
        root = jumped
    flat = x.reshape(height * width, -1)
    return flat[read[root]].reshape(x.shape)


# ------------------------------------------------------------------------------------------------- noise
def gaussian_noise(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Additive N(0, c) noise on the [0, 1] scale."""
    c = PARAMETERS["gaussian_noise"][severity - 1]
    x = _unit(image)
    return _to_uint8(np.clip(x + random_state(rng).normal(size=x.shape, scale=c), 0, 1) * 255)


def shot_noise(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Poisson noise: x' = Poisson(x * c) / c."""
    c = PARAMETERS["shot_noise"][severity - 1]
    x = _unit(image)
    return _to_uint8(np.clip(random_state(rng).poisson(x * c) / float(c), 0, 1) * 255)


def impulse_noise(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Salt and pepper on a fraction c of the values (each channel on its own), half salt, half pepper.

    skimage's ``random_noise(mode='s&p')``, which the original called: a value is hit when a uniform draw is
    <= c, and salted when a second one (drawn for every value, after all the first ones) is <= 0.5."""
    c = PARAMETERS["impulse_noise"][severity - 1]
    state = random_state(rng)
    x = _unit(image)
    hit = state.random_sample(x.shape) <= c
    salt = state.random_sample(x.shape) <= 0.5
    x[hit & salt] = 1
    x[hit & ~salt] = 0
    return _to_uint8(x * 255)


def speckle_noise(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Multiplicative noise: x' = x + x * N(0, c)."""
    c = PARAMETERS["speckle_noise"][severity - 1]
    x = _unit(image)
    return _to_uint8(np.clip(x + x * random_state(rng).normal(size=x.shape, scale=c), 0, 1) * 255)


# -------------------------------------------------------------------------------------------------- blur
def gaussian_blur(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """Gaussian blur of sigma c pixels."""
    return _to_uint8(np.clip(_blur(_unit(image), PARAMETERS["gaussian_blur"][severity - 1]), 0, 1) * 255)


def defocus_blur(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """Convolution with an anti-aliased disk of the given radius (pixels)."""
    radius, alias_sigma = PARAMETERS["defocus_blur"][severity - 1]
    # the disk on a grid of at least -8..8, softened by a small Gaussian (3 x 3, or 5 x 5 beyond radius 8)
    span, ksize = (8, 3) if radius <= 8 else (radius, 5)
    grid = np.arange(-span, span + 1)
    xx, yy = np.meshgrid(grid, grid)
    disk = (xx**2 + yy**2 <= radius**2).astype(np.float32)
    disk /= disk.sum()
    kernel = cv2.GaussianBlur(disk, ksize=(ksize, ksize), sigmaX=alias_sigma)
    x = _unit(image)
    blurred = np.stack([cv2.filter2D(x[:, :, d], -1, kernel) for d in range(3)], axis=-1)
    return _to_uint8(np.clip(blurred, 0, 1) * 255)


def glass_blur(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Gaussian blur, local pixel shuffling (``iterations`` passes, offsets in [-delta, delta)), blur again.

    Cost: the original's shuffle is a Python loop over every pixel (about 0.5 s per pass at 224 px); here it is
    vectorised (see ``_shuffle_pixels``) with the same result, draw for draw: about 7 ms per image at 224 px."""
    sigma, delta, iterations = PARAMETERS["glass_blur"][severity - 1]
    state = random_state(rng)
    x = _to_uint8(_blur(_unit(image), sigma) * 255)  # the original shuffles a truncated uint8 image
    for _ in range(iterations):
        x = _shuffle_pixels(x, delta, state)
    return _to_uint8(np.clip(_blur(_unit(x), sigma), 0, 1) * 255)


def motion_blur(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Motion blur of (radius, sigma) at an angle ~ U(-45, 45) degrees.

    The original ran ImageMagick's MotionBlurImage; this is the numpy port of its kernel from
    ``imagecorruptions`` (see the module docstring)."""
    radius, sigma = PARAMETERS["motion_blur"][severity - 1]
    angle = random_state(rng).uniform(-45, 45)
    return _to_uint8(_motion_blur(image, radius, sigma, angle))


def zoom_blur(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """The mean of the image and its centre zooms by each factor of np.arange(1, stop, step)."""
    stop, step = PARAMETERS["zoom_blur"][severity - 1]
    factors = np.arange(1, stop, step)
    x = _unit(image).astype(np.float32)
    total = np.zeros_like(x)
    for factor in factors:
        total += _clipped_zoom(x, factor)
    return _to_uint8(np.clip((x + total) / (len(factors) + 1), 0, 1) * 255)


# ----------------------------------------------------------------------------------------------- weather
def snow(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Snow flakes: thresholded zoomed Gaussian noise, motion blurred at U(-135, -45) degrees, added together
    with its 180-degree rotation to a whitened image.

    The original blurred the flakes in ImageMagick (see the module docstring); its 8-bit output is kept by
    rounding the blurred layer to 1/255 steps. As in the original, the zoomed flakes are cropped to the image
    before the blur; ``imagecorruptions`` blurs the uncropped layer, which at 224 px differs near the borders
    (severities 1, 4, 5, whose zoom overshoots by a pixel)."""
    loc, scale, zoom, threshold, radius, sigma, blend = PARAMETERS["snow"][severity - 1]
    state = random_state(rng)
    x = image.astype(np.float32) / 255.0
    flakes = state.normal(size=x.shape[:2], loc=loc, scale=scale)
    flakes = _clipped_zoom(flakes[..., None], zoom)
    flakes[flakes < threshold] = 0
    flakes = np.clip(flakes[..., 0], 0, 1)
    flakes = _motion_blur(flakes, radius, sigma, state.uniform(-135, -45))
    flakes = (np.round(flakes * 255).astype(np.uint8) / 255.0)[..., None]
    # whiten: towards max(x, 1.5 * grey + 0.5)
    grey = cv2.cvtColor(x, cv2.COLOR_RGB2GRAY)[..., None]
    x = blend * x + (1 - blend) * np.maximum(x, grey * 1.5 + 0.5)
    return _to_uint8(np.clip(x + flakes + np.rot90(flakes, k=2), 0, 1) * 255)


def frost_directory(frost_dir: str | Path | None = None) -> Path:
    """The folder of the frost textures: ``frost_dir``, else data/imagenet_c_frost, the textures of ImageNet-C
    as the imagecorruptions 1.1.2 wheel ships them (byte-identical; see data/PROVENANCE.md)."""
    folder = Path(frost_dir) if frost_dir is not None else DATA_DIR / "imagenet_c_frost"
    missing = [name for name in FROST_FILES if not (folder / name).is_file()]
    if missing:
        raise UserError(
            f"frost texture folder {folder} lacks {', '.join(missing)}; expected a folder holding "
            f"{', '.join(FROST_FILES)} (e.g. data/imagenet_c_frost of this repository)"
        )
    return folder


@cache
def _frost_texture(path: str) -> np.ndarray:
    texture = cv2.imread(path)  # BGR, as the original read it
    if texture is None:
        raise UserError(f"frost texture {path} could not be read as an image")
    texture.setflags(write=False)  # shared by every call in this process
    return texture


def frost(image: np.ndarray, severity: int = 1, rng: RNG = None, frost_dir: str | Path | None = None) -> np.ndarray:
    """x' = a * x + b * (a random crop of one of 5 frost textures), on the 0..255 scale.

    Texture index, then crop row, then crop column are drawn. As in the original, the texture is used at its
    own size when it is larger than the image (224 px: always); ``imagecorruptions`` always enlarges it by 1.1
    first. A texture not larger than the image is enlarged as ``imagecorruptions`` does (by 1.1 times the
    factor that makes it cover the image, bicubic)."""
    weight_image, weight_frost = PARAMETERS["frost"][severity - 1]
    state = random_state(rng)
    folder = frost_directory(frost_dir)
    texture = _frost_texture(str(folder / FROST_FILES[state.randint(5)]))
    height, width = image.shape[:2]
    if texture.shape[0] <= height or texture.shape[1] <= width:  # the random crop needs a larger texture
        factor = 1.1 * max(height / texture.shape[0], width / texture.shape[1])
        size = (int(np.ceil(texture.shape[1] * factor)), int(np.ceil(texture.shape[0] * factor)))
        texture = cv2.resize(texture, dsize=size, interpolation=cv2.INTER_CUBIC)
    top = state.randint(0, texture.shape[0] - height)
    left = state.randint(0, texture.shape[1] - width)
    crop = texture[top : top + height, left : left + width, ::-1]  # BGR to RGB
    return _to_uint8(weight_image * image + weight_frost * crop)


def fog(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Fog: a plasma fractal (amplitude, decay) added, and the range compressed to keep the brightest value.
    The fractal is drawn at the next power of two of the larger side and cropped (256 at 224 px)."""
    amplitude, decay = PARAMETERS["fog"][severity - 1]
    height, width = image.shape[:2]
    size = 1 << (max(height, width) - 1).bit_length()
    x = _unit(image)
    peak = x.max()
    x += amplitude * _plasma_fractal(size, decay, random_state(rng))[:height, :width, None]
    return _to_uint8(np.clip(x * peak / (peak + amplitude), 0, 1) * 255)


def spatter(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """Water (severities 1-3) or mud (4-5) splashes from thresholded, blurred Gaussian noise.

    Water: the blobs' edges (Canny), a capped distance transform, histogram equalisation and an emboss-like
    filter shape pale turquoise (175, 238, 238) highlights added to the image. Mud: the blobs, blurred and
    cut at 0.8, are painted brown (63, 42, 20). Computed in float32 as the original did (``imagecorruptions``
    computes the mud colour in float64, which can move a value by one grey level). A noise draw with no blob
    at all (only possible on small images) leaves the image as it is, where the original divided by zero."""
    loc, scale, sigma, threshold, intensity, mud = PARAMETERS["spatter"][severity - 1]
    x = image.astype(np.float32) / 255.0
    liquid = _gaussian(random_state(rng).normal(size=x.shape[:2], loc=loc, scale=scale), sigma)
    liquid[liquid < threshold] = 0
    if not mud:
        liquid = (np.clip(liquid, 0, 1) * 255).astype(np.uint8)
        dist = cv2.distanceTransform(255 - cv2.Canny(liquid, 50, 150), cv2.DIST_L2, 5)
        _, dist = cv2.threshold(dist, 20, 20, cv2.THRESH_TRUNC)
        dist = cv2.equalizeHist(cv2.blur(dist, (3, 3)).astype(np.uint8))
        dist = cv2.filter2D(dist, cv2.CV_8U, np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]]))
        mask = liquid * cv2.blur(dist, (3, 3)).astype(np.float32)
        peak = mask.max()
        if peak > 0:
            mask /= peak
        mask *= intensity
        tint = (np.array([175, 238, 238]) / 255.0).astype(np.float32)
        return _to_uint8(np.clip(x + mask[..., None] * tint, 0, 1) * 255)
    mask = _gaussian(np.where(liquid > threshold, 1, 0).astype(np.float32), intensity)
    mask[mask < 0.8] = 0
    mask = mask[..., None]
    colour = (np.array([63, 42, 20]) / 255.0).astype(np.float32) * mask
    return _to_uint8(np.clip(x * (1 - mask) + colour, 0, 1) * 255)


# ----------------------------------------------------------------------------------------------- digital
def brightness(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """HSV value channel + c."""
    hsv = rgb2hsv(_unit(image))
    hsv[..., 2] = np.clip(hsv[..., 2] + PARAMETERS["brightness"][severity - 1], 0, 1)
    return _to_uint8(np.clip(hsv2rgb(hsv), 0, 1) * 255)


def saturate(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """HSV saturation channel * m + o."""
    factor, offset = PARAMETERS["saturate"][severity - 1]
    hsv = rgb2hsv(_unit(image))
    hsv[..., 1] = np.clip(hsv[..., 1] * factor + offset, 0, 1)
    return _to_uint8(np.clip(hsv2rgb(hsv), 0, 1) * 255)


def contrast(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """Each channel pulled towards its mean: x' = (x - mean) * c + mean."""
    c = PARAMETERS["contrast"][severity - 1]
    x = _unit(image)
    means = x.mean(axis=(0, 1), keepdims=True)
    return _to_uint8(np.clip((x - means) * c + means, 0, 1) * 255)


def elastic_transform(image: np.ndarray, severity: int = 1, rng: RNG = None) -> np.ndarray:
    """A random affine warp (3 anchor points jittered by U(+-j)), then a smooth random displacement field
    (uniform noise blurred with sigma, times alpha), bilinear with reflected borders.

    Follows the original script: ``imagecorruptions`` has a different elastic transform (no affine warp, its
    own parameters). The original's constants are multiples of 244 px at 224 px; at another size they scale
    with the shorter side (244 * side / 224), the way ``imagecorruptions`` makes its elastic transform
    relative to the image size."""
    a, b, j = PARAMETERS["elastic_transform"][severity - 1]
    state = random_state(rng)
    x: np.ndarray = image.astype(np.float32) / 255.0
    shape = x.shape[:2]
    unit = 244 * min(shape) / 224  # exactly 244 at 224 px
    alpha, sigma, jitter = unit * a, unit * b, unit * j
    # affine: three points around the centre, each moved by up to +-jitter pixels
    centre = np.array(shape, dtype=np.float32) // 2
    arm = min(shape) // 3
    anchors = np.array([centre + arm, [centre[0] + arm, centre[1] - arm], centre - arm], dtype=np.float32)
    moved = anchors + state.uniform(-jitter, jitter, size=anchors.shape).astype(np.float32)
    x = cv2.warpAffine(x, cv2.getAffineTransform(anchors, moved), shape[::-1], borderMode=cv2.BORDER_REFLECT_101)
    dx, dy = (
        (_gaussian(state.uniform(-1, 1, size=shape), sigma, mode="reflect", truncate=3) * alpha).astype(np.float32)
        for _ in range(2)
    )
    rows = np.arange(shape[0])[:, None, None] + dy[..., None]
    cols = np.arange(shape[1])[None, :, None] + dx[..., None]
    coordinates = np.broadcast_arrays(rows, cols, np.arange(3)[None, None, :])
    warped = map_coordinates(x, coordinates, order=1, mode="reflect")
    return _to_uint8(np.clip(warped, 0, 1) * 255)


def pixelate(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """Box-downscale to int(side * c), box-upscale back. Follows the original script (BOX both ways);
    ``imagecorruptions`` upscales with NEAREST instead."""
    c = PARAMETERS["pixelate"][severity - 1]
    height, width = image.shape[:2]
    small = Image.fromarray(image).resize((int(width * c), int(height * c)), Image.Resampling.BOX)
    return np.array(small.resize((width, height), Image.Resampling.BOX))


def jpeg_compression(image: np.ndarray, severity: int = 1) -> np.ndarray:
    """A JPEG round trip at quality c (Pillow)."""
    return jpeg_round_trip(image, PARAMETERS["jpeg_compression"][severity - 1])


def jpeg_round_trip(image: np.ndarray, quality: int) -> np.ndarray:
    """Encode as JPEG at ``quality`` (Pillow's defaults, 4:2:0 chroma subsampling) and decode."""
    buffer = BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    with Image.open(buffer) as decoded:
        return np.array(decoded.convert("RGB"))


# -------------------------------------------------------------------------------------------- dispatching
# in the benchmark's order: the 15 of mCE, then the 4 extra ones
CORRUPTIONS: dict[str, Callable[..., np.ndarray]] = {
    f.__name__: f
    for f in (
        gaussian_noise,
        shot_noise,
        impulse_noise,
        defocus_blur,
        glass_blur,
        motion_blur,
        zoom_blur,
        snow,
        frost,
        fog,
        brightness,
        contrast,
        elastic_transform,
        pixelate,
        jpeg_compression,
        speckle_noise,
        gaussian_blur,
        spatter,
        saturate,
    )
}
RANDOM = frozenset(
    {
        "gaussian_noise",
        "shot_noise",
        "impulse_noise",
        "speckle_noise",
        "glass_blur",
        "motion_blur",
        "snow",
        "frost",
        "fog",
        "spatter",
        "elastic_transform",
    }
)


def corrupt(
    image: np.ndarray, corruption: str, severity: int, rng: RNG = None, frost_dir: str | Path | None = None
) -> np.ndarray:
    """``image`` (H x W x 3 uint8, H and W >= 32) corrupted by ``corruption`` at ``severity`` 1..5, as
    H x W x 3 uint8. ``rng`` feeds the random corruptions (see the module docstring; None: fresh OS entropy);
    ``frost_dir``: the frost textures (default: data/imagenet_c_frost)."""
    if corruption not in CORRUPTIONS:
        raise UserError(f"unknown corruption {corruption!r}; expected one of {', '.join(CORRUPTIONS)}")
    if severity not in (1, 2, 3, 4, 5):
        raise UserError(f"corruption severity must be among 1..5, got {severity}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < MIN_SIZE:
        raise ValueError(f"expected an H x W x 3 uint8 image with H, W >= {MIN_SIZE}, got {image.dtype} {image.shape}")
    function = CORRUPTIONS[corruption]
    if corruption == "frost":
        return function(image, severity, rng, frost_dir)
    return function(image, severity, rng) if corruption in RANDOM else function(image, severity)


# --------------------------------------------------------------------------------------- the benchmark pipeline
def image_seed(seed: int, corruption: str, severity: int, pixels: np.ndarray) -> np.random.RandomState:
    """The random state of one image in one cell: from (seed, corruption, severity, a digest of the image's
    clean preprocessed pixels). The digest stands for the image's identity, so the draw does not depend on
    the loader worker, the rank, the batch or the data source (folder or shards) that delivered the image."""
    digest = int.from_bytes(hashlib.blake2b(np.ascontiguousarray(pixels).tobytes(), digest_size=16).digest(), "little")
    entropy = [seed, list(CORRUPTIONS).index(corruption), severity, digest]
    return np.random.RandomState(np.random.MT19937(np.random.SeedSequence(entropy)))


def release_transform(resolution: int, crop_pct: float = 0.875) -> Callable[[Image.Image], "torch.Tensor"]:
    """The released ImageNet-C's preprocessing: torchvision ``Resize(256)`` with its default (bilinear, on PIL
    images) and ``CenterCrop(224)`` (create_c/make_imagenet_c.py of hendrycks/robustness), at resolution r:
    shorter side to floor(r / crop_pct), centre crop r. Not the bicubic resize of our clean evaluation."""
    # imported here: the corruptions themselves need only numpy, OpenCV, scikit-image and Pillow
    from torchvision.transforms import v2 as T  # noqa: PLC0415

    from robust_lightning.data.transforms import decode_rgb, eval_resize_size  # noqa: PLC0415

    resize = T.Resize(eval_resize_size(resolution, crop_pct), interpolation=T.InterpolationMode.BILINEAR)
    preprocess: Callable[[Image.Image], torch.Tensor] = T.Compose(
        [decode_rgb, resize, T.CenterCrop(resolution), T.PILToTensor()]
    )
    return preprocess


class CorruptedEvalTransform:
    """Per-image transform of the on-the-fly benchmark: lazily opened PIL image -> S x 3 x r x r uint8 tensor,
    one slice per severity, made as the released ImageNet-C was made: its resize (``release_transform``), the
    corruption, a JPEG round trip at quality 85 (the release saved with optimize=True too, which changes only
    the file size)."""

    def __init__(
        self,
        corruption: str,
        severities: list[int],
        resolution: int,
        seed: int = 0,
        crop_pct: float = 0.875,
        frost_dir: str | Path | None = None,
    ):
        if corruption not in CORRUPTIONS:
            raise UserError(f"unknown corruption {corruption!r}; expected one of {', '.join(CORRUPTIONS)}")
        if resolution < MIN_SIZE:
            raise UserError(f"corruptions need images of at least {MIN_SIZE} px, got resolution {resolution}")
        self.corruption, self.severities, self.seed = corruption, list(severities), seed
        self.frost_dir = str(frost_directory(frost_dir)) if corruption == "frost" else None
        self.preprocess = release_transform(resolution, crop_pct)

    def __call__(self, image: Image.Image) -> "torch.Tensor":
        import torch  # noqa: PLC0415 (see __init__)

        clean = np.ascontiguousarray(self.preprocess(image).permute(1, 2, 0).numpy())  # decodes; r x r x 3 uint8
        out = []
        for severity in self.severities:
            rng = image_seed(self.seed, self.corruption, severity, clean)
            corrupted = corrupt(clean, self.corruption, severity, rng, self.frost_dir)
            out.append(jpeg_round_trip(corrupted, RELEASED_JPEG_QUALITY))
        return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()
