"""The data module's loaders and batches: collate (corrupt images dropped and counted), the epoch-aware loaders
of the training set, micro-batches, and the random draws keyed by seed, epoch, batch and rank.
"""

import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from robust_lightning.data.augment import BatchAugment
from robust_lightning.data.batch import Batch
from robust_lightning.data.datasets import Corrupt, ShardStream


def draw_seed(*key: int) -> int:
    """A 64-bit seed that is a function of ``key`` alone; NumPy's SeedSequence keeps the streams of neighbouring
    keys (the next step, the next rank) apart."""
    return int(np.random.SeedSequence([k % 2**63 for k in key]).generate_state(1, np.uint64)[0])


def split_micro_batches(batch: Batch, parts: int) -> Iterator[Batch]:
    """A rank's share of one optimiser step as ``parts`` micro-batches of sizes differing by at most one (the first
    ones larger; data.max_device_batch_size). Undecodable images are reported with the first part."""
    size = len(batch["label"])
    start = 0
    for part in range(parts):
        end = start + size // parts + (part < size % parts)
        yield {
            key: (value if part == 0 else []) if key == "corrupt" else value[start:end] for key, value in batch.items()
        }
        start = end


def with_draws(batches: Iterable[Batch], epoch: int, micro_batches: int) -> Iterator[Batch]:
    """Each training batch split into its micro-batches and tagged with ``draw`` = (epoch, index in the epoch): the
    key of its augmentation's random streams (ImageNetDataModule.batch_streams)."""
    index = 0
    for batch in batches:
        for part in split_micro_batches(batch, micro_batches) if micro_batches > 1 else (batch,):
            if isinstance(part, dict):  # the data module's batches (another collate's pass as they are)
                part["draw"] = (epoch, index)
            index += 1
            yield part


def collate(items: list[dict | Corrupt], augment: BatchAugment | None = None) -> Batch:
    """Batch the good samples; report the corrupt ones by name instead of failing the batch.

    Image and label travel in one sample, so dropping a sample can never shift labels. ``augment`` (per-image
    augmentation in the loader workers, data.augment_on 'cpu') runs on the batch; the result goes back to uint8
    so batches still cross to the device at a quarter of the float size.
    """
    good = [item for item in items if not isinstance(item, Corrupt)]
    bad = [f"{item.key} ({item.reason})" for item in items if isinstance(item, Corrupt)]
    images = torch.stack([item["image"] for item in good]) if good else torch.empty(0, dtype=torch.uint8)
    labels = torch.tensor([item["label"] for item in good], dtype=torch.long)
    if augment is not None and good:
        images = augment(images, labels)[0].mul_(255).round_().to(torch.uint8)
    batch = {"image": images, "label": labels, "key": [item["key"] for item in good], "corrupt": bad}
    if good and "geometry" in good[0]:  # canvases for the device-side crop
        batch["geometry"] = torch.stack([item["geometry"] for item in good])
    return batch


class EpochLoader(DataLoader):
    """The training loader of a map-style dataset: each optimiser step's batch of this rank, as ``micro_batches``
    micro-batches tagged with their augmentation's stream key (``with_draws``).

    Iteration starts at the first batch rather than when the iterator is created: a fit resumed from a checkpoint
    creates its training iterator before it restores the epoch counter and calls the sampler's set_epoch; worker
    processes would already have drawn the indices of epoch 0. The workers' own random draws (a crop in the
    workers) come from a generator seeded with (data.seed, epoch, rank) at every epoch, so a resumed run draws
    what the uninterrupted one drew: such workers cannot persist across epochs.
    """

    def __init__(self, dataset, *, micro_batches: int = 1, rank: int = 0, **kwargs):
        super().__init__(dataset, **kwargs)
        self.micro_batches, self.rank = micro_batches, rank

    def __len__(self) -> int:
        return super().__len__() * self.micro_batches

    def __iter__(self):
        epoch = self.sampler.epoch
        if not self.persistent_workers:
            self.generator = torch.Generator().manual_seed(draw_seed(self.sampler.seed, epoch, self.rank, 2))
        yield from with_draws(super().__iter__(), epoch, self.micro_batches)


class ShardTrainLoader(DataLoader):
    """An endless ShardStream cut into epochs of a fixed number of optimiser steps, each of ``micro_batches``
    micro-batches tagged with their augmentation's stream key (``with_draws``).

    All ranks take the same number of steps (DDP needs it). The epoch is read from the trainer when an
    epoch starts so the shard order changes every epoch and follows a resumed run.
    """

    def __init__(
        self,
        dataset: ShardStream,
        batches_per_epoch: int,
        current_epoch,
        *,
        micro_batches: int = 1,
        rank: int = 0,
        **kwargs,
    ):
        super().__init__(dataset, **kwargs)
        self.batches_per_epoch = batches_per_epoch
        self.current_epoch = current_epoch
        self.micro_batches, self.rank = micro_batches, rank

    def __len__(self) -> int:
        return self.batches_per_epoch * self.micro_batches

    def __iter__(self):
        # A generator: the epoch is read at the first batch, not when Lightning creates the iterator (a fit
        # resumed from a checkpoint creates it before its epoch counter is restored).
        epoch = self.dataset.epoch = self.current_epoch()
        # the workers' seeds come from (seed, epoch, rank), not from the global generator: creating the iterator
        # draws nothing from it, and a resumed run's workers draw what the uninterrupted run's drew
        self.generator = torch.Generator().manual_seed(draw_seed(self.dataset.seed, epoch, self.rank, 2))
        yield from with_draws(itertools.islice(super().__iter__(), self.batches_per_epoch), epoch, self.micro_batches)
