"""What a training batch goes through after decoding: the random-resized crop of canvases, the augmentation scheme
and MixUp/CutMix, on the device by default or partly in the loader workers, each batch drawing from random streams
of its own (so that a resumed run draws what the run left alone drew).
"""

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch

from robust_lightning.data.augment import BatchAugment
from robust_lightning.data.batch import Batch
from robust_lightning.data.crop import random_resized_crop
from robust_lightning.data.loaders import collate, draw_seed


class TrainingAugmentation:
    """The augmentation after the crop, on the device (``on`` "device") or per image in the workers with
    MixUp/CutMix, which needs the whole batch's labels, still on the device (``on`` "cpu")."""

    def __init__(
        self,
        scheme: str,
        num_classes: int,
        *,
        on: str,
        fill: str,
        label_smoothing: float,
        image_size: int,
        crop_scale: tuple[float, float],
        seed: int,
        rank: int = 0,
    ):
        self.image_size, self.crop_scale, self.seed, self.rank = image_size, crop_scale, seed, rank
        # the paper's basic = crop only
        options: dict[str, Any] = dict(flip=scheme != "basic", label_smoothing=label_smoothing, augmentation_fill=fill)
        self.worker: BatchAugment | None = None
        self.device: BatchAugment | None = BatchAugment(scheme, num_classes, **options)
        if on == "cpu":
            # RandomErasing goes to the device with the mixing: timm erases float tensors, and the official
            # noise leaves [0, 1], which the workers' uint8 batches cannot carry.
            self.worker = BatchAugment(scheme, num_classes, **options, mix=False, erase_prob=0)
            self.device = None
            if scheme == "heavy":
                mixing = dict(flip=False, rand_augment="", mix=True)
                self.device = BatchAugment("heavy", num_classes, **(options | mixing))
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def collate(self) -> Callable[..., Batch]:
        """The loaders' collate function: with the workers' part of the augmentation where they have one."""
        return partial(collate, augment=self.worker) if self.worker else collate

    def streams(
        self, draw: tuple[int, int] | None, device: torch.device
    ) -> tuple[torch.Generator | None, np.random.RandomState | None]:
        """The random streams of one training batch's augmentation on ``device``: a torch generator for the
        per-image draws (crop box, flip, RandAugment ops and magnitudes, erasing boxes and noise) and a NumPy
        RandomState for the batch's MixUp/CutMix draws (weight, switch, box), both functions of (data.seed, epoch,
        batch index, rank) alone (``draw`` = (epoch, index), set by the training loaders). Without a draw key:
        the global generators."""
        if draw is None:
            return None, None
        epoch, index = draw
        generator = self._generators.get(device)
        if generator is None:  # one per device, reseeded per batch (seeding reads nothing back from the device)
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed(draw_seed(self.seed, epoch, index, self.rank, 0))
        return generator, np.random.RandomState(np.random.MT19937(draw_seed(self.seed, epoch, index, self.rank, 1)))

    def on_device(self, batch: dict[str, Any], augment: bool) -> dict[str, Any]:
        """uint8 crossed to the device: crop training canvases, augment (``augment``: training batches) and
        scale to [0, 1] there."""
        generator, mix_rng = self.streams(batch.get("draw"), batch["image"].device)
        if "geometry" in batch:  # training canvases: the crop comes first
            batch["image"] = random_resized_crop(
                batch["image"], batch["geometry"], self.image_size, self.crop_scale, generator=generator
            )
        if augment and self.device is not None and batch["label"].numel():
            images, targets = self.device(batch["image"], batch["label"], generator=generator, mix_rng=mix_rng)
            if targets.ndim == 2:  # MixUp/CutMix soft targets; "label" stays the unmixed class
                batch["target"] = targets
            batch["image"] = images
        else:
            batch["image"] = batch["image"].float().div_(255)
        return batch

    def batches(
        self, loader: Iterable[dict[str, Any]], images: int, device: torch.device | str, seed: int
    ) -> Iterator[dict[str, Any]]:
        """The first ``images`` images of ``loader``, moved to ``device`` and augmented as in training, drawing
        from streams keyed by ``seed`` that no training epoch uses."""
        seen = 0
        for index, batch in enumerate(loader):
            if not batch["label"].numel():
                continue
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            batch = self.on_device({**batch, "draw": (-1 - seed, index)}, augment=True)
            take = min(len(batch["label"]), images - seen)  # cut after mixing: the partners were in the batch
            seen += take
            yield {k: v if k in ("corrupt", "draw") else v[:take] for k, v in batch.items()}
            if seen >= images:
                return
