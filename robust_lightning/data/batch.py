"""What a batch carries: the one definition of the keys that data, training and evaluation exchange.

The loaders (``datamodule.collate``) emit uint8 images; ``ImageNetDataModule.on_after_batch_transfer`` scales
them to [0, 1] floats on the device (and, when training with MixUp/CutMix, adds ``target``). Evaluation
callbacks that read the evaluation images themselves get the same [0, 1] floats from
``robust_lightning.evaluation.base.Evaluation.eval_batches``.

``label`` is always the integer class of an image; ``target`` always the soft (probability) target of a
training image, N x num_classes, and only present when MixUp/CutMix made one. Nothing else uses these names.
"""

from typing import TypedDict

import torch

IMAGE = "image"  # N x 3 x H x W: uint8 from the loader; float in [0, 1] on the device
LABEL = "label"  # N, int64: the class index
KEY = "key"  # N strings: the image's name (file name without extension, or shard key); unique per image
TARGET = "target"  # N x num_classes float: MixUp/CutMix soft targets (training only, when mixing is on)
CORRUPT = "corrupt"  # "name (reason)" of the images that could not be decoded and were left out of the batch
GEOMETRY = "geometry"  # per image: where the random crop of a training canvas lies (data.augment_on: device)
DRAW = "draw"  # training batches: (epoch, index in the epoch), the key of the augmentation's random streams


class Batch(TypedDict, total=False):
    """A batch as the data module's loaders emit it (``image``, ``label``, ``key``, ``corrupt`` always)."""

    image: torch.Tensor
    label: torch.Tensor
    key: list[str]
    target: torch.Tensor
    draw: tuple[int, int]
    corrupt: list[str]
    geometry: torch.Tensor


class PredictedBatch(TypedDict):
    """What ``predict`` makes of a batch (``ImageClassifier.predict_step``), as the prediction writer writes it:
    the batch's keys and labels, with each image's top-5 classes and their probabilities (N x 5 each)."""

    key: list[str]
    label: torch.Tensor
    top5: torch.Tensor
    top5_prob: torch.Tensor


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Label-smoothed one-hot targets, the same values timm's Mixup gives an unmixed image."""
    off = smoothing / num_classes
    return torch.full((labels.numel(), num_classes), off, device=labels.device).scatter_(
        1, labels.view(-1, 1), 1.0 - smoothing + off
    )
