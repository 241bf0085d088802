"""Per-image preprocessing on the CPU side of the pipeline.

Every transform takes a lazily opened PIL image and starts by decoding it, so that training can decode
large JPEGs at reduced scale (``CanvasDecode``). Resizing runs on PIL images, as in the reference
evaluation (PIL's bicubic filter, not the tensor approximation of it). Transforms end in uint8 tensors: batches cross to
the accelerator at a quarter of the float32 size and are scaled to [0, 1] there
(ImageNetDataModule.on_after_batch_transfer). No mean/std normalisation happens here:
every model takes [0, 1] images and carries its own normaliser.
"""

import math
from collections.abc import Callable

import torch
from PIL import Image
from torchvision.transforms import v2 as T
from torchvision.transforms.v2.functional import pil_to_tensor

BICUBIC = T.InterpolationMode.BICUBIC

# a per-image transform: a lazily opened image in, its uint8 tensor out, or its sample fields (CanvasDecode)
ImageTransform = Callable[[Image.Image], torch.Tensor | dict[str, torch.Tensor]]


def decode_rgb(image: Image.Image) -> Image.Image:
    return image.convert("RGB")  # forces the full decode, so truncated files fail here and not later


def eval_resize_size(image_size: int, crop_pct: float) -> int:
    """The paper's evaluation resize: shorter side to floor(r / crop_pct) (224 -> 256 at crop_pct 0.875)."""
    return math.floor(image_size / crop_pct)


EVAL_RESIZES = ("shorter_side", "whole")


def eval_transform(image_size: int, crop_pct: float = 0.875, resize: str = "shorter_side") -> T.Compose:
    """The evaluation preprocessing (``resize``, bicubic both):

    - "shorter_side": resize the shorter side to floor(r / crop_pct), centre-crop r (timm's and the papers');
    - "whole": resize the whole image to r x r, aspect ratio ignored, no crop (Bhojanapalli et al. 2021, App. A,
      "Image Preprocessing"; crop_pct unused).
    """
    if resize == "whole":
        return T.Compose([decode_rgb, T.Resize((image_size, image_size), interpolation=BICUBIC), T.PILToTensor()])
    return T.Compose(
        [
            decode_rgb,
            T.Resize(eval_resize_size(image_size, crop_pct), interpolation=BICUBIC),
            T.CenterCrop(image_size),
            T.PILToTensor(),
        ]
    )


def describe_eval_preprocessing(image_size: int, crop_pct: float, resize: str = "shorter_side") -> str:
    """What results.json says of ``eval_transform(image_size, crop_pct, resize)``."""
    if resize == "whole":
        return f"resize {image_size}x{image_size} bicubic (whole image, aspect ratio ignored), no crop"
    return f"resize {eval_resize_size(image_size, crop_pct)} bicubic, center crop {image_size}"


def train_transform(image_size: int, scale: tuple[float, float] = (0.08, 1.0)) -> T.Compose:
    """Decode at full resolution and RandomResizedCrop (PIL bicubic) in the loader workers, as uint8: the
    official pipeline's crop (data.augment_on 'cpu', or data.full_resolution_decode).

    Otherwise, with data.augment_on 'device', the workers run ``CanvasDecode`` instead and the crop happens on
    the device (robust_lightning.data.crop), like the rest of the augmentation (robust_lightning.data.augment).
    """
    crop = T.RandomResizedCrop(image_size, scale=scale, interpolation=BICUBIC)
    return T.Compose([decode_rgb, crop, T.PILToTensor()])


def default_canvas_size(image_size: int) -> int:
    return math.ceil(image_size * 16 / 7)  # 512 for 224 crops: holds nearly every ImageNet image unreduced


class CanvasDecode:
    """Decode into the top-left corner of a black ``size`` x ``size`` uint8 canvas, the only CPU work of
    device-side augmentation. Returns the canvas and the geometry (original h, original w, canvas h,
    canvas w) the device-side RandomResizedCrop needs.

    An image whose longer side exceeds ``size`` is decoded at a reduced scale: JPEGs through libjpeg's DCT
    scaling by 2, 4 or 8 (cheaper than a full decode), anything still too large by Pillow's box reduction.
    Crops of a reduced image differ from those of the full-resolution one (benchmarks/decode_scale.py);
    data.full_resolution_decode uses ``train_transform`` instead, as the official pipeline.
    """

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image: Image.Image) -> dict[str, torch.Tensor]:
        width, height = image.size
        longest = max(width, height)
        if longest > self.size and image.format == "JPEG":
            scale = next((k for k in (2, 4, 8) if math.ceil(longest / k) <= self.size), 8)
            image.draft("RGB", (max(1, width // scale), max(1, height // scale)))  # this exact DCT scale
        image = decode_rgb(image)
        if max(image.size) > self.size:
            image = image.reduce(math.ceil(max(image.size) / self.size))
        pixels = pil_to_tensor(image)
        canvas = torch.zeros((3, self.size, self.size), dtype=torch.uint8)
        canvas[:, : pixels.shape[1], : pixels.shape[2]] = pixels
        geometry = torch.tensor([height, width, pixels.shape[1], pixels.shape[2]], dtype=torch.int32)
        return {"image": canvas, "geometry": geometry}


def draw_without_decoding(transform: ImageTransform, image: Image.Image) -> None:
    """Make the random draws ``transform`` makes for ``image``, without decoding its pixels (``image`` opened
    lazily: its size is in its header).

    A fit resumed mid-epoch passes the images the interrupted attempt had already trained on through this instead
    of ``transform``: the loader workers' random streams (the crop of data.full_resolution_decode and
    data.augment_on cpu) then reach the stop in the state they had there, at the cost of reading headers."""
    for step in transform.transforms if isinstance(transform, T.Compose) else [transform]:
        if isinstance(step, T.RandomResizedCrop):
            step.make_params([image])  # the crop box: the size is all it reads
        elif not (step is decode_rgb or isinstance(step, (T.PILToTensor, CanvasDecode))):
            raise TypeError(f"no draw-only form of the training transform {step!r}: say which draws it makes here")
