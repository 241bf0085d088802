"""What an evaluation may ask of the data module (``EvaluationData``), and the types it answers with. The
evaluation and analysis packages read the data only through this contract; ImageNetDataModule provides it.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from robust_lightning.data.transforms import ImageTransform


class TrainingSample(NamedTuple):
    """Augmented training batches of a fixed random subset of the training set (``training_sample``)."""

    batches: Iterator[dict[str, Any]]  # as training_step receives them: on the device, images in [0, 1]
    images: int  # images the batches hold (at most: an image that fails to decode is dropped)
    subset_images: int  # round(fraction * training_images): the subset before the max_images cap
    training_images: int  # the training set (held-out images excluded)
    transform: dict[str, Any]  # the training transform the batches went through, as results.json records it


@dataclass(frozen=True)
class EvaluationSource:
    """Where a data module's evaluation images come from, as an evaluation reports it (``evaluation_source``)."""

    kind: str  # data.source's name for itself ("folder", "shards", "synthetic"): reported, never branched on
    location: str | None  # where the images are read from (DataSource.location): resume identities record it
    imagenet_val: bool  # ImageNet val with ImageNet's labels: class_map imagenet, no holdout
    subset: str | None = None  # data.eval_subset: the listed images evaluated
    limit: int | None = None  # data.eval_limit: the first n images evaluated
    val_folder: str | None = None  # the val split as a folder of image files a benchmark may read by path
    own_preprocessing: bool = True  # an evaluation may read the images through a transform of its own (not tensors)


@runtime_checkable
class EvaluationData(Protocol):
    """What an evaluation or analysis (robust_lightning.evaluation, robust_lightning.analysis) may ask of the
    data module, and all it may ask; ImageNetDataModule provides it. The data module's other attributes are its
    own: an evaluation reads them through these, never directly.

    - ``image_size``, ``crop_pct``: the evaluation preprocessing (resize the shorter side to
      floor(image_size / crop_pct), centre crop image_size), the default resolution of an evaluation;
    - ``eval_resize``: "shorter_side" (that), or "whole" (the whole image resized to image_size, no crop);
    - ``num_workers``: decoding processes per device, the default of an evaluation's own loaders;
    - ``evaluation_source()``: where the evaluation images come from (``EvaluationSource``);
    - ``eval_dataloader_with(transform, batch_size, num_workers)``: this rank's evaluation images through
      another per-image transform (None: the data's own evaluation preprocessing);
    - ``expected_eval_images()``: how many (and which) evaluation images a complete epoch reads;
    - ``training_sample(...)``: augmented training batches of a fixed subset of the training set;
    - ``conditions()``: what results.json records about the data.
    """

    image_size: int
    crop_pct: float
    eval_resize: str
    num_workers: int

    def evaluation_source(self) -> EvaluationSource: ...

    def eval_dataloader_with(
        self, transform: ImageTransform | None, batch_size: int | None = None, num_workers: int | None = None
    ) -> DataLoader[object]: ...

    def expected_eval_images(self) -> tuple[int | None, frozenset[str] | None]: ...

    def training_sample(
        self,
        device: torch.device | str,
        fraction: float = 1.0,
        max_images: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> TrainingSample: ...

    def conditions(self) -> dict[str, Any]: ...


def evaluation_data(trainer: pl.Trainer) -> EvaluationData | None:
    """The trainer's data module where it provides ``EvaluationData`` (ImageNetDataModule, the Python API's
    images), None for another data module or none."""
    data = getattr(trainer, "datamodule", None)
    return data if isinstance(data, EvaluationData) else None
