"""Per-image preprocessing on the CPU side of the pipeline.

Resizing runs on PIL images, as in the reference evaluation (PIL's bicubic filter, not the tensor
approximation of it). Transforms end in uint8 tensors: batches cross to the accelerator at a quarter of the float32 size and are
scaled to [0, 1] there (ImageNetDataModule.on_after_batch_transfer). No mean/std normalisation happens here:
every model takes [0, 1] images and carries its own normaliser.
"""

import math

from torchvision.transforms import v2 as T

BICUBIC = T.InterpolationMode.BICUBIC


def eval_resize_size(image_size: int, crop_pct: float) -> int:
    """The paper's evaluation resize: shorter side to floor(r / crop_pct) (224 -> 256 at crop_pct 0.875)."""
    return math.floor(image_size / crop_pct)


def eval_transform(image_size: int, crop_pct: float = 0.875) -> T.Compose:
    """Resize the shorter side to floor(r / crop_pct) (bicubic), centre-crop r."""
    return T.Compose(
        [
            T.Resize(eval_resize_size(image_size, crop_pct), interpolation=BICUBIC),
            T.CenterCrop(image_size),
            T.PILToTensor(),
        ]
    )


def train_transform(image_size: int, scale: tuple[float, float] = (0.08, 1.0)) -> T.Compose:
    """The CPU part of every training augmentation: RandomResizedCrop (PIL bicubic), as uint8.

    The crop needs the whole decoded image, so it happens here; flip, RandAugment, erasing and MixUp/CutMix
    work on fixed-size batches and run in robust_lightning.data.augment (on the device by default).
    """
    return T.Compose([T.RandomResizedCrop(image_size, scale=scale, interpolation=BICUBIC), T.PILToTensor()])
