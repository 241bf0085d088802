"""Our ImageNet-C corruptions (robust_lightning.evaluation.corruptions) against the reference.

The reference is the ``imagecorruptions`` 1.1.2 package, run unchanged through a test-only shim (its imports and
calls are broken against today's setuptools, scikit-image and numpy), with numpy's global RNG seeded as our code
gets ``RandomState(seed)``: every random corruption consumes the same draws in the same order, so the comparison is
exact. Where imagecorruptions departs from Hendrycks' make_imagenet_c.py (elastic_transform, frost's texture
scaling, snow's trim), the test says what is compared instead.

Agreement per corruption:
- exact (every pixel equal) with imagecorruptions at 64 x 64 and 40 x 72, all severities: gaussian_noise,
  shot_noise, impulse_noise, speckle_noise, defocus_blur, glass_blur, motion_blur, zoom_blur, gaussian_blur, fog,
  brightness, contrast, saturate, jpeg_compression, spatter (severities 1-3);
- pixelate: exact with the original's box-down / box-up at 224, and with imagecorruptions (box-down / nearest-up)
  at 224 and 64 px, where box upscaling picks the same source pixel as nearest (at other sizes ties can differ);
- spatter 4-5 (mud): within 1 grey level on < 0.1% of the values (imagecorruptions makes the colour in float64,
  the original and we in float32);
- snow at 224: exact at least 26 px from the borders (imagecorruptions motion-blurs the 225-px zoomed layer before
  cropping it, the original crops first, as we do), exact everywhere at severities 2 and 3 (no crop needed);
- frost: exact with the original's formula at 224 (texture crop unscaled) and exact with imagecorruptions on an
  image larger than every texture (both scale the texture up the same way);
- elastic_transform: exact with a transcription of the original's function at 224 (imagecorruptions has another).
A wrong severity is caught: every corruption's output differs between neighbouring severities under one seed.
"""

import sys
import types
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from robust_lightning.errors import UserError
from robust_lightning.evaluation.corruptions import (
    CORRUPTIONS,
    FROST_FILES,
    PARAMETERS,
    CorruptedEvalTransform,
    corrupt,
    frost_directory,
    image_seed,
    jpeg_round_trip,
)
from robust_lightning.paths import DATA_DIR

SEVERITIES = (1, 2, 3, 4, 5)
EXACT = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "speckle_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "gaussian_blur",
    "fog",
    "brightness",
    "contrast",
    "saturate",
    "jpeg_compression",
)


def natural_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Gradients, a flat patch with edges, and some texture: enough structure for blurs, edges and colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (height + width) + 60], -1)
    image[height // 4 : height // 2, width // 4 : width // 2] = [200, 30, 90]
    return np.clip(image + rng.integers(-20, 21, image.shape), 0, 255).astype(np.uint8)


# ------------------------------------------------------------------------------------------------- reference
@pytest.fixture(scope="module")
def reference():
    """imagecorruptions 1.1.2 made importable and runnable unchanged, for this module's tests only:
    - ``pkg_resources`` (gone from setuptools >= 81): a stand-in whose resource_filename resolves next to the module;
    - ``np.float_`` (gone in numpy 2): an alias of float64;
    - skimage ``gaussian(..., multichannel=True)`` (removed): translated to channel_axis=-1;
    - skimage ``random_noise`` now draws from its own unseeded Generator; the scikit-image of 2018 drew from numpy's
      global RNG, so it is handed a Generator over the global RNG's bit generator (same stream as before)."""
    import skimage.filters
    import skimage.util

    gaussian, random_noise = skimage.filters.gaussian, skimage.util.random_noise

    def gaussian_compat(image, sigma=1, multichannel=None, **kwargs):
        if multichannel:
            kwargs["channel_axis"] = -1
        return gaussian(image, sigma, **kwargs)

    def random_noise_global(image, **kwargs):
        return random_noise(image, rng=np.random.Generator(np.random.get_bit_generator()), **kwargs)

    def resource_filename(package: str, path: str) -> str:
        return str(Path(sys.modules[package].__file__).parent / path)

    with pytest.MonkeyPatch.context() as patch:
        fake = types.ModuleType("pkg_resources")
        fake.resource_filename = resource_filename
        patch.setitem(sys.modules, "pkg_resources", fake)
        patch.setattr(np, "float_", np.float64, raising=False)
        patch.setattr(skimage.util, "random_noise", random_noise_global)
        try:
            import imagecorruptions
        except Exception as e:  # not installed, or broken beyond the shim
            pytest.skip(f"the reference imagecorruptions==1.1.2 cannot be imported ({type(e).__name__}: {e})")
        patch.setattr(imagecorruptions.corruptions, "gaussian", gaussian_compat)
        yield imagecorruptions


def run_reference(reference, name: str, image: np.ndarray, severity: int, seed: int) -> np.ndarray:
    """imagecorruptions' output with numpy's global RNG seeded (the global state is restored afterwards)."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        return reference.corrupt(image, severity=severity, corruption_name=name)
    finally:
        np.random.set_state(state)


def ours(name: str, image: np.ndarray, severity: int, seed: int) -> np.ndarray:
    return corrupt(image, name, severity, np.random.RandomState(seed))


# ------------------------------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("shape", [(64, 64), (40, 72)])
@pytest.mark.parametrize("name", EXACT)
def test_equal_to_imagecorruptions(reference, name, shape):
    image = natural_image(*shape)
    for severity in SEVERITIES:
        expected = run_reference(reference, name, image, severity, seed=10 + severity)
        got = ours(name, image, severity, seed=10 + severity)
        assert got.dtype == np.uint8 and got.shape == image.shape
        assert np.array_equal(got, expected), f"{name} severity {severity}"


def test_spatter_water_equal_and_mud_within_one_grey_level(reference):
    image = natural_image(64, 64)
    for seed in range(3):
        for severity in SEVERITIES:
            expected = run_reference(reference, "spatter", image, severity, seed).astype(int)
            got = ours("spatter", image, severity, seed).astype(int)
            if severity <= 3:  # water: the same float32 arithmetic
                assert np.array_equal(got, expected), f"spatter severity {severity}"
            else:  # mud: float64 colour there, float32 here; only a truncation at a grey-level boundary moves
                assert np.abs(got - expected).max() <= 1 and (got != expected).mean() < 1e-3
                assert (expected != image).mean() > 0.01 or severity == 4  # the mud is there to compare


def test_snow_equal_away_from_the_borders_at_224(reference):
    image = natural_image(224, 224)
    margin = 2 * max(p[4] for p in PARAMETERS["snow"]) + 2  # the longest motion blur, and its 180-degree copy
    for severity in SEVERITIES:
        for seed in range(2):
            expected = run_reference(reference, "snow", image, severity, seed)
            got = ours("snow", image, severity, seed)
            assert np.array_equal(got[margin:-margin, margin:-margin], expected[margin:-margin, margin:-margin])
            if severity in (2, 3):  # the zoomed layer is exactly 224: nothing to crop, equal everywhere
                assert np.array_equal(got, expected)
            assert (got != image).mean() > 0.05  # there is snow to compare


def test_frost_equal_to_the_original_at_224_and_to_imagecorruptions_when_scaled(reference):
    textures = Path(reference.__file__).parent / "frost"
    image = natural_image(224, 224)
    for severity in SEVERITIES:
        a, b = PARAMETERS["frost"][severity - 1]
        draws = np.random.RandomState(severity)  # the original: texture index, crop row, crop column
        texture = cv2.imread(str(textures / FROST_FILES[draws.randint(5)]))
        top, left = draws.randint(0, texture.shape[0] - 224), draws.randint(0, texture.shape[1] - 224)
        expected = np.uint8(
            np.clip(a * image + b * texture[top : top + 224, left : left + 224][..., [2, 1, 0]], 0, 255)
        )
        assert np.array_equal(ours("frost", image, severity, seed=severity), expected)
    large = natural_image(640, 928)  # larger than every texture (at most 600 x 900): both scale them up
    for severity in SEVERITIES:
        assert np.array_equal(
            ours("frost", large, severity, seed=severity),
            run_reference(reference, "frost", large, severity, seed=severity),
        )


def original_elastic_transform(image: np.ndarray, severity: int, rng: np.random.RandomState) -> np.ndarray:
    """Transcribed from hendrycks/robustness ImageNet-C/create_c/make_imagenet_c.py (Apache-2.0, commit e0377d4),
    the test reference for 224 px: np.random replaced by ``rng``, skimage's gaussian by today's call."""
    from scipy.ndimage import map_coordinates
    from skimage.filters import gaussian

    c = [
        (244 * 2, 244 * 0.7, 244 * 0.1),
        (244 * 2, 244 * 0.08, 244 * 0.2),
        (244 * 0.05, 244 * 0.01, 244 * 0.02),
        (244 * 0.07, 244 * 0.01, 244 * 0.02),
        (244 * 0.12, 244 * 0.01, 244 * 0.02),
    ][severity - 1]
    image = np.array(image, dtype=np.float32) / 255.0
    shape = image.shape
    shape_size = shape[:2]
    center_square = np.float32(shape_size) // 2
    square_size = min(shape_size) // 3
    pts1 = np.float32(
        [
            center_square + square_size,
            [center_square[0] + square_size, center_square[1] - square_size],
            center_square - square_size,
        ]
    )
    pts2 = pts1 + rng.uniform(-c[2], c[2], size=pts1.shape).astype(np.float32)
    M = cv2.getAffineTransform(pts1, pts2)
    image = cv2.warpAffine(image, M, shape_size[::-1], borderMode=cv2.BORDER_REFLECT_101)
    dx = (gaussian(rng.uniform(-1, 1, size=shape[:2]), c[1], mode="reflect", truncate=3) * c[0]).astype(np.float32)
    dy = (gaussian(rng.uniform(-1, 1, size=shape[:2]), c[1], mode="reflect", truncate=3) * c[0]).astype(np.float32)
    dx, dy = dx[..., np.newaxis], dy[..., np.newaxis]
    x, y, z = np.meshgrid(np.arange(shape[1]), np.arange(shape[0]), np.arange(shape[2]))
    indices = np.reshape(y + dy, (-1, 1)), np.reshape(x + dx, (-1, 1)), np.reshape(z, (-1, 1))
    return np.uint8(np.clip(map_coordinates(image, indices, order=1, mode="reflect").reshape(shape), 0, 1) * 255)


def test_elastic_transform_equal_to_the_original_at_224():
    image = natural_image(224, 224)
    for severity in SEVERITIES:
        expected = original_elastic_transform(image, severity, np.random.RandomState(severity))
        assert np.array_equal(ours("elastic_transform", image, severity, seed=severity), expected)


def test_pixelate_is_box_down_and_box_up_as_the_original(reference):
    image = natural_image(224, 224)
    for severity, c in zip(SEVERITIES, PARAMETERS["pixelate"]):
        side = int(224 * c)  # 134, 112, 89, 67, 56
        expected = Image.fromarray(image).resize((side, side), Image.BOX).resize((224, 224), Image.BOX)
        got = ours("pixelate", image, severity, 0)
        assert np.array_equal(got, np.asarray(expected))
        assert np.array_equal(got, run_reference(reference, "pixelate", image, severity, 0))
        small = natural_image(64, 64)
        expected_small = run_reference(reference, "pixelate", small, severity, 0)
        assert np.array_equal(ours("pixelate", small, severity, 0), expected_small)


def test_a_wrong_severity_would_be_caught():
    """Every corruption's output changes from one severity to the next under the same draws, so the exact
    comparisons above fail for a wrong parameter. (224 px: pixelate and jpeg differ at every severity there.)"""
    image = natural_image(224, 224)
    for name in CORRUPTIONS:
        outputs = [ours(name, image, severity, seed=0) for severity in SEVERITIES]
        for severity in SEVERITIES[:-1]:
            assert not np.array_equal(outputs[severity - 1], outputs[severity]), f"{name} {severity}"


# ------------------------------------------------------------------------------------------ the implementation
def test_every_corruption_and_severity_keeps_shape_and_dtype_at_another_size():
    image = natural_image(48, 80)
    for name in CORRUPTIONS:
        for severity in SEVERITIES:
            out = corrupt(image, name, severity, rng=np.random.default_rng(severity))
            assert out.dtype == np.uint8 and out.shape == image.shape, (name, severity)
            assert not np.array_equal(out, image), (name, severity)


def test_randomness_comes_only_from_the_rng_argument():
    image = natural_image(64, 64)
    np.random.seed(0)
    first = corrupt(image, "gaussian_noise", 3, rng=5)
    np.random.seed(1)  # the global RNG plays no part
    assert np.array_equal(corrupt(image, "gaussian_noise", 3, rng=5), first)
    assert not np.array_equal(corrupt(image, "gaussian_noise", 3, rng=6), first)
    generator = np.random.default_rng(5)  # a Generator's bit generator is used and advanced
    one, two = (corrupt(image, "fog", 2, rng=generator) for _ in range(2))
    assert not np.array_equal(one, two)
    assert np.array_equal(corrupt(image, "fog", 2, rng=np.random.default_rng(5)), one)


def test_bad_inputs_and_missing_frost_textures(tmp_path):
    image = natural_image(64, 64)
    with pytest.raises(UserError, match="unknown corruption 'fogg'"):
        corrupt(image, "fogg", 1)
    with pytest.raises(UserError, match="among 1..5"):
        corrupt(image, "fog", 6)
    with pytest.raises(ValueError, match="H, W >= 32"):
        corrupt(image[:20], "fog", 1)
    with pytest.raises(UserError, match=r"lacks frost1.png, .*frost5.jpg; expected a folder holding"):
        corrupt(image, "frost", 1, rng=0, frost_dir=tmp_path)
    assert frost_directory() == DATA_DIR / "imagenet_c_frost"  # shipped with the repository


def test_the_shipped_frost_textures_are_the_reference_packages(reference):
    """data/imagenet_c_frost holds the six textures of imagecorruptions 1.1.2 byte for byte."""
    shipped, packaged = DATA_DIR / "imagenet_c_frost", Path(reference.__file__).parent / "frost"
    names = sorted(p.name for p in packaged.iterdir())
    assert names == sorted(p.name for p in shipped.iterdir()) == [*FROST_FILES, "frost6.jpg"]
    for name in names:
        assert (shipped / name).read_bytes() == (packaged / name).read_bytes(), name


# ----------------------------------------------------------------------------------------------- the pipeline
def test_pipeline_at_224_is_the_release_resize_256_crop_224_corrupt_jpeg_85(tmp_path):
    path = tmp_path / "source.JPEG"
    Image.fromarray(natural_image(300, 400, seed=3)).save(path, quality=95)
    # the release's own preprocessing: torchvision Resize(256) at its default interpolation, CenterCrop(224)
    release = torchvision.transforms.Compose(
        [torchvision.transforms.Resize(256), torchvision.transforms.CenterCrop(224)]
    )
    clean = np.asarray(release(Image.open(path).convert("RGB")))
    # which is bilinear, not the bicubic resize of the clean evaluation
    bicubic = Image.open(path).convert("RGB").resize((341, 256), Image.BICUBIC).crop((58, 16, 58 + 224, 16 + 224))
    assert not np.array_equal(clean, np.asarray(bicubic))
    for name in ("contrast", "gaussian_noise"):
        transform = CorruptedEvalTransform(name, [2, 5], resolution=224, seed=7)
        out = transform(Image.open(path))
        assert out.dtype == torch.uint8 and out.shape == (2, 3, 224, 224)
        for i, severity in enumerate((2, 5)):
            corrupted = corrupt(clean, name, severity, image_seed(7, name, severity, clean))
            expected = jpeg_round_trip(corrupted, 85)
            assert torch.equal(out[i], torch.from_numpy(expected).permute(2, 0, 1))
    # the draws depend on (seed, corruption, severity, pixels) only: another seed changes the noise
    other = CorruptedEvalTransform("gaussian_noise", [5], resolution=224, seed=8)(Image.open(path))
    assert not torch.equal(other[0], out[1])


def test_pipeline_at_another_resolution():
    image = Image.fromarray(natural_image(90, 70, seed=4))
    out = CorruptedEvalTransform("zoom_blur", [1, 3], resolution=48)(image)
    assert out.shape == (2, 3, 48, 48) and out.dtype == torch.uint8
    with pytest.raises(UserError, match="at least 32 px"):
        CorruptedEvalTransform("zoom_blur", [1], resolution=24)
