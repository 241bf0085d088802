"""RandomResizedCrop on the accelerator, so that the loader workers only decode.

The workers decode each training image into a fixed-size uint8 canvas (``transforms.CanvasDecode``): the
image sits in the top-left corner, and images larger than the canvas are decoded at a reduced scale (JPEG
DCT scaling) so that they fit. Each sample carries its geometry ``(original h, original w, h on canvas,
w on canvas)``. Here, on the device, crop boxes are drawn per image exactly as torchvision's
``RandomResizedCrop.get_params`` draws them on the original size, and each box is resized to the output
size with Pillow's bicubic filter: antialiased, window clipped to the crop, horizontal pass then vertical,
each rounded to 8 bits. Both passes are batched matrix products with per-sample resampling matrices, so a
whole batch costs two ``bmm``s and no host sync. On images that fit the canvas the result equals
``torchvision.transforms.v2.RandomResizedCrop(size, interpolation=BICUBIC)`` on the PIL image up to
Pillow's fixed-point rounding (tests/test_crop.py).
"""

import math

import torch
from torch import Tensor

ATTEMPTS = 10  # torchvision's rejection-sampling tries before the centre-crop fallback
_BICUBIC_A = -0.5  # Pillow's bicubic kernel


def sample_crop_boxes(
    sizes: Tensor,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> Tensor:
    """Per-image RandomResizedCrop boxes ``(top, left, height, width)`` for images of ``sizes`` (B, 2) = (h, w).

    torchvision's algorithm, vectorised: ten (area, log-aspect) draws per image, the first that fits wins,
    otherwise the centre crop with the aspect ratio clamped into ``ratio``.
    """
    n, device = sizes.shape[0], sizes.device
    height, width = sizes.double().unbind(1)
    area = (height * width)[:, None]
    u_area, u_ratio, u_top, u_left = torch.rand((4, n, ATTEMPTS), generator=generator, device=device).double()
    target = area * (u_area * (scale[1] - scale[0]) + scale[0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(u_ratio * (log_hi - log_lo) + log_lo)
    w = torch.round(torch.sqrt(target * aspect))
    h = torch.round(torch.sqrt(target / aspect))
    fits = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
    first = fits.int().argmax(1, keepdim=True)  # index of the first fitting draw (0 when none fits)
    w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
    top = torch.floor(u_top.gather(1, first)[:, 0] * (height - h + 1))
    left = torch.floor(u_left.gather(1, first)[:, 0] * (width - w + 1))

    in_ratio = width / height
    fallback_w = torch.where(in_ratio > ratio[1], torch.round(height * ratio[1]), width)
    fallback_h = torch.where(in_ratio < ratio[0], torch.round(width / ratio[0]), height)
    fallback = ~fits.any(1)
    h, w = torch.where(fallback, fallback_h, h), torch.where(fallback, fallback_w, w)
    top = torch.where(fallback, torch.div(height - h, 2, rounding_mode="floor"), top)
    left = torch.where(fallback, torch.div(width - w, 2, rounding_mode="floor"), left)
    return torch.stack([top, left, h, w], 1).float()


def _bicubic(t: Tensor) -> Tensor:
    t = t.abs()
    a = _BICUBIC_A
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return torch.where(t < 1, near, torch.where(t < 2, far, torch.zeros_like(t)))


def resample_matrices(start: Tensor, length: Tensor, in_size: int, out_size: int) -> Tensor:
    """(B, out_size, in_size) matrices resampling the spans [start, start + length) of a line of ``in_size``
    pixels to ``out_size`` pixels with Pillow's antialiased bicubic (support widened by the reduction factor,
    weights normalised over the pixels inside the span)."""
    step = (length / out_size)[:, None, None]
    widen = step.clamp(min=1.0)
    centres = start[:, None, None] + (torch.arange(out_size, device=start.device)[None, :, None] + 0.5) * step
    pixels = torch.arange(in_size, device=start.device, dtype=start.dtype)[None, None, :]
    weights = _bicubic((pixels + 0.5 - centres) / widen)
    inside = (pixels >= torch.floor(start)[:, None, None]) & (pixels < torch.ceil(start + length)[:, None, None])
    weights = weights * inside
    return weights / weights.sum(-1, keepdim=True)


def resized_crop(canvas: Tensor, boxes: Tensor, size: int) -> Tensor:
    """Crop ``boxes`` (B, 4) = (top, left, h, w) in canvas pixels out of uint8 ``canvas`` (B, C, H, W) and
    resize each crop to ``size`` x ``size``; returns uint8 (B, C, size, size)."""
    top, left, h, w = boxes.float().unbind(1)
    _, _, height, width = canvas.shape
    rows = resample_matrices(top, h, height, size)  # (B, size, H)
    cols = resample_matrices(left, w, width, size)  # (B, size, W)
    images = canvas.float()
    horizontal = (images @ cols.transpose(1, 2)[:, None]).round_().clamp_(0, 255)  # (B, C, H, size)
    return (rows[:, None] @ horizontal).round_().clamp_(0, 255).to(torch.uint8)


def random_resized_crop(
    canvas: Tensor,
    geometry: Tensor,
    size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> Tensor:
    """RandomResizedCrop of a batch of canvases; ``geometry`` (B, 4) = (original h, original w, canvas h,
    canvas w). Boxes are drawn on the original size and mapped onto the (possibly reduced) canvas image."""
    geometry = geometry.to(canvas.device).float()
    boxes = sample_crop_boxes(geometry[:, :2], scale, ratio, generator)
    reduction = (geometry[:, 2:] / geometry[:, :2]).repeat(1, 2)  # (y, x, y, x) factors
    return resized_crop(canvas, boxes * reduction, size)
