"""Device-side RandomResizedCrop (robust_lightning.data.crop) against torchvision on PIL images, and the
canvas decoding that feeds it (robust_lightning.data.transforms.CanvasDecode)."""

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from robust_lightning.data.crop import random_resized_crop, resized_crop, sample_crop_boxes
from robust_lightning.data.transforms import CanvasDecode, default_canvas_size

BICUBIC = T.InterpolationMode.BICUBIC


def photo_like(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth structure plus mild noise, like a photograph (pure noise exaggerates bicubic overshoot)."""
    rng = np.random.default_rng(seed)
    coarse = torch.from_numpy(rng.uniform(0, 255, (1, 3, height // 8 + 2, width // 8 + 2)))
    smooth = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)[0]
    noisy = smooth.permute(1, 2, 0).numpy() + rng.normal(0, 6, (height, width, 3))
    return np.clip(np.round(noisy), 0, 255).astype(np.uint8)


def on_canvas(pixels: np.ndarray, size: int) -> torch.Tensor:
    canvas = torch.zeros((1, 3, size, size), dtype=torch.uint8)
    canvas[0, :, : pixels.shape[0], : pixels.shape[1]] = torch.from_numpy(pixels.copy()).permute(2, 0, 1)
    return canvas


def pil_resized_crop(pixels: np.ndarray, box, size: int) -> torch.Tensor:
    image = Image.fromarray(pixels)
    return TF.pil_to_tensor(TF.resized_crop(image, *box, [size, size], interpolation=BICUBIC)).int()


BOXES = [(0, 0, 97, 131), (10, 20, 30, 40), (5, 7, 90, 100), (50, 60, 8, 9), (0, 81, 97, 50), (3, 0, 12, 131)]


@pytest.mark.parametrize("size", [24, 64, 150])
@pytest.mark.parametrize("box", BOXES)
def test_resized_crop_is_pillows_bicubic_crop_and_resize(box, size):
    pixels = photo_like(97, 131)
    ours = resized_crop(on_canvas(pixels, 160), torch.tensor([box]), size)[0].int()
    assert ours.shape == (3, size, size)
    # Pillow sums in fixed point (ties can round the other way) and, since Pillow 13, runs the vertical pass
    # first for some shapes (we keep its long-standing horizontal-first order); both only move pixels by one
    # level of the 8-bit intermediate.
    difference = (ours - pil_resized_crop(pixels, box, size)).abs()
    assert difference.max() <= 2 and difference.float().mean() < 0.25


@pytest.mark.parametrize("box, size", [((0, 0, 97, 50), 97), ((0, 0, 40, 131), 131), ((4, 9, 60, 60), 60)])
def test_single_axis_resize_is_pillow_exactly_up_to_ties(box, size):
    # with one axis unscaled the pass order cannot matter, so only fixed-point ties remain
    pixels = photo_like(97, 131, seed=1)
    top, left, h, w = box
    ours = resized_crop(on_canvas(pixels, 160), torch.tensor([box]), size)[0].int()
    crop = Image.fromarray(pixels).crop((left, top, left + w, top + h)).resize((size, size), Image.BICUBIC)
    reference = TF.pil_to_tensor(crop).int()
    assert (ours - reference).abs().max() <= 1 and (ours != reference).float().mean() < 0.01


def test_resized_crop_agrees_with_torch_antialiased_bicubic_in_float():
    # an independent float computation of the same filter: differences only from 8-bit rounding between passes
    pixels = photo_like(97, 131, seed=2)
    boxes = torch.tensor([(10, 20, 30, 40), (0, 0, 97, 131), (20, 5, 70, 120)])
    ours = resized_crop(on_canvas(pixels, 140).expand(3, -1, -1, -1), boxes, 48).float()
    for n, (top, left, h, w) in enumerate(boxes.tolist()):
        crop = torch.from_numpy(pixels.copy()).permute(2, 0, 1)[None, :, top : top + h, left : left + w].double()
        reference = F.interpolate(crop, size=(48, 48), mode="bicubic", antialias=True, align_corners=False)
        assert (ours[n] - reference[0].clamp(0, 255)).abs().max() <= 1.5


def test_crop_boxes_follow_torchvision_get_params():
    sizes = torch.tensor([[375, 500]] * 20000)
    boxes = sample_crop_boxes(sizes, generator=torch.Generator().manual_seed(0))
    top, left, h, w = boxes.unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 375).all() and (left + w <= 500).all()
    assert torch.equal(boxes, boxes.round())  # integer pixel boxes, as torchvision's
    torch.manual_seed(0)
    reference = torch.tensor(
        [T.RandomResizedCrop.get_params(torch.empty(3, 375, 500), (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(20000)],
        dtype=torch.float32,
    )

    def statistics(b):  # area fraction, log aspect ratio, vertical centre
        return b[:, 2] * b[:, 3] / (375 * 500), (b[:, 3] / b[:, 2]).log(), b[:, 0] + b[:, 2] / 2

    for ours, theirs in zip(statistics(boxes), statistics(reference)):
        standard_error = math.sqrt((ours.var() + theirs.var()).item() / 20000)
        assert abs(ours.mean() - theirs.mean()) < 4 * standard_error
        spread = theirs.quantile(0.9) - theirs.quantile(0.1)
        assert abs(ours.quantile(0.9) - theirs.quantile(0.9)) < 0.03 * spread


@pytest.mark.parametrize("height, width", [(10, 1000), (1000, 10)])
def test_centre_crop_fallback_is_torchvisions(height, width):
    # no draw fits such a thin image, so both fall back to the same deterministic centre crop
    ours = sample_crop_boxes(torch.tensor([[height, width]]))[0].tolist()
    theirs = T.RandomResizedCrop.get_params(torch.empty(3, height, width), (0.08, 1.0), (3 / 4, 4 / 3))
    assert ours == list(theirs)


def test_random_resized_crop_of_a_reduced_canvas_approximates_the_full_resolution_crop():
    pixels = photo_like(900, 1200, seed=3)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=95)
    sample = CanvasDecode(512)(Image.open(io.BytesIO(encoded.getvalue())))
    assert sample["geometry"].tolist() == [900, 1200, 225, 300]  # DCT-scaled by 4 to fit 512
    # scale (1, 1) with the image's own aspect ratio: the crop is the whole image, resized to 64
    out = random_resized_crop(sample["image"][None], sample["geometry"][None], 64, scale=(1, 1), ratio=(4 / 3, 4 / 3))
    full = TF.pil_to_tensor(Image.open(io.BytesIO(encoded.getvalue())).convert("RGB").resize((64, 64), Image.BICUBIC))
    assert (out[0].float() - full.float()).abs().mean() < 2.0


def test_canvas_decode_keeps_small_images_exact_and_reduces_large_ones():
    small = photo_like(37, 50, seed=4)
    png = io.BytesIO()
    Image.fromarray(small).save(png, format="PNG")
    sample = CanvasDecode(64)(Image.open(io.BytesIO(png.getvalue())))
    assert sample["image"].shape == (3, 64, 64) and sample["image"].dtype == torch.uint8
    assert sample["geometry"].tolist() == [37, 50, 37, 50]
    assert torch.equal(sample["image"][:, :37, :50], torch.from_numpy(small).permute(2, 0, 1))
    assert sample["image"][:, 37:].eq(0).all() and sample["image"][:, :, 50:].eq(0).all()

    large = io.BytesIO()
    Image.fromarray(photo_like(100, 300, seed=5)).save(large, format="PNG")  # not JPEG: box reduction
    sample = CanvasDecode(64)(Image.open(io.BytesIO(large.getvalue())))
    assert sample["geometry"].tolist() == [100, 300, 20, 60]  # reduced by ceil(300 / 64) = 5


def test_default_canvas_holds_typical_imagenet_images_unreduced():
    assert default_canvas_size(224) == 512 and default_canvas_size(32) >= 64


def test_training_batches_are_canvases_cropped_on_the_device(tmp_path):
    from robust_lightning.data.datamodule import ImageNetDataModule
    from robust_lightning.data.sources import SyntheticSource

    dm = ImageNetDataModule(
        source=SyntheticSource(
            root=str(tmp_path / "synthetic"),
            num_classes=4,
            train_per_class=4,
            val_per_class=2,
            image_size=40,
            samples_per_shard=8,
        ),
        image_size=32,
        batch_size=8,
        num_workers=0,
    )
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    canvas = default_canvas_size(32)
    assert batch["image"].shape == (8, 3, canvas, canvas) and batch["geometry"][:, :2].eq(40).all()
    dm.trainer = type("T", (), {"training": True})()
    out = dm.on_after_batch_transfer(batch, 0)
    assert out["image"].shape == (8, 3, 32, 32) and out["image"].dtype == torch.float32
    assert "canvas_size" in dm.conditions()
