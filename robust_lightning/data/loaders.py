"""The data module's loaders and batches: collate (corrupt images dropped and counted), the epoch-aware loaders
of the training set, micro-batches, and the random draws keyed by seed, epoch, batch and rank.

A fit resumed mid-epoch (from a step checkpoint, SLURM's hpc_ckpt_N.ckpt, a SIGTERM's last.ckpt) trains exactly
the batches of that epoch that its interrupted attempt had not trained, with the same draws. The training loaders
are checkpoint state for it (``TrainingPosition``): the batches the attempt had trained are replayed, not loaded
(robust_lightning.data.datasets.Replayed): the loader workers make those images' random draws from their headers,
so that the draws of every later image are the interrupted attempt's, and the batches are dropped before training.
"""

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from robust_lightning.data.augment import BatchAugment
from robust_lightning.data.batch import Batch
from robust_lightning.data.datasets import Corrupt, HoldoutStream, Item, Replayed, ShardStream
from robust_lightning.data.samplers import GlobalBatchSampler
from robust_lightning.data.worker_start import StartCheckedLoader
from robust_lightning.job_signals import ignore_job_signals


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
        yield cast(
            Batch,
            {
                key: (value if part == 0 else []) if key == "corrupt" else value[start:end]
                for key, value in cast(dict[str, Any], batch).items()
            },
        )
        start = end


def with_draws(batches: Iterable[Batch], epoch: int, micro_batches: int) -> Iterator[Batch]:
    """Each training batch split into its micro-batches and tagged with ``draw`` = (epoch, index in the epoch): the
    key of its augmentation's random streams (ImageNetDataModule.batch_streams). Replayed batches (trained before a
    resume) are counted, not yielded."""
    index = 0
    for batch in batches:
        if isinstance(batch, dict) and "replayed" in batch:
            index += micro_batches
            continue
        for part in split_micro_batches(batch, micro_batches) if micro_batches > 1 else (batch,):
            if isinstance(part, dict):  # the data module's batches (another collate's pass as they are)
                part["draw"] = (epoch, index)
            index += 1
            yield part


def collate(items: list[Item], augment: BatchAugment | None = None) -> Batch:
    """Batch the good samples; report the corrupt ones by name instead of failing the batch.

    Image and label travel in one sample, so dropping a sample can never shift labels. ``augment`` (per-image
    augmentation in the loader workers, data.augment_on 'cpu') runs on the batch; the result goes back to uint8
    so batches still cross to the device at a quarter of the float size. A replayed batch (a resumed epoch's
    images trained before the stop) makes ``augment``'s random draws on stand-in images and carries nothing else.
    """
    replayed = sum(isinstance(item, Replayed) for item in items)
    if replayed:
        if augment is not None:  # its draws depend on the batch size alone
            augment(torch.zeros(replayed, 3, 8, 8, dtype=torch.uint8), torch.zeros(replayed, dtype=torch.long))
        return cast(Batch, {"replayed": replayed})  # a replayed batch's marker, which with_draws passes on
    good = [item for item in items if not isinstance(item, (Corrupt, Replayed))]  # none replayed here
    bad = [f"{item.key} ({item.reason})" for item in items if isinstance(item, Corrupt)]
    images = torch.stack([item["image"] for item in good]) if good else torch.empty(0, dtype=torch.uint8)
    labels = torch.tensor([item["label"] for item in good], dtype=torch.long)
    if augment is not None and good:
        images = augment(images, labels)[0].mul_(255).round_().to(torch.uint8)
    batch: Batch = {"image": images, "label": labels, "key": [item["key"] for item in good], "corrupt": bad}
    if good and "geometry" in good[0]:  # canvases for the device-side crop
        batch["geometry"] = torch.stack([item["geometry"] for item in good])
    return batch


class TrainingPosition:
    """How far training got in its epoch: checkpoint state of the data module (``ImageNetDataModule.state_dict``).

    The data module records each training micro-batch as it moves to the device (its ``draw`` key says which it
    is), so a checkpoint written at the end of a step holds that step's position. A resumed fit's loader starts its
    epoch by replaying the steps trained before: ``replay_steps``, once, and only in the epoch the position is of.
    """

    def __init__(self) -> None:
        self.epoch, self.micro_batches = 0, 0
        self._resume: tuple[int, int] | None = None

    def record(self, draw: tuple[int, int]) -> None:
        self.epoch, self.micro_batches = draw[0], draw[1] + 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "micro_batches": self.micro_batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = (int(state["epoch"]), int(state["micro_batches"]))

    def replay_steps(self, epoch: int, micro_batches: int) -> int:
        """The optimiser steps of ``epoch`` trained before the resume (checkpoints are written at the end of a
        step, after all of its micro-batches)."""
        resume, self._resume = self._resume, None
        return resume[1] // micro_batches if resume is not None and resume[0] == epoch else 0


class ResumableLoader(StartCheckedLoader):
    """A training loader whose position in its epoch is checkpoint state (``TrainingPosition``).

    Lightning saves and restores the state of a loader that has ``state_dict``/``load_state_dict``, and warns that
    a mid-epoch resume is inexact for one that has not. It restores that state only into a loader it builds after
    the checkpoint is loaded, though, which the learning-rate schedule's ``trainer.estimated_stepping_batches``
    prevents (it builds the loader first): the data module's own checkpoint state, restored before any loader is
    built, carries the same position, and whichever restores it first sets it (the same value)."""

    def __init__(self, dataset: Dataset[Item], *, position: TrainingPosition | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.position = position or TrainingPosition()

    def state_dict(self) -> dict[str, int]:
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position.load_state_dict(state)


class EpochLoader(ResumableLoader):
    """The training loader of a map-style dataset: each optimiser step's batch of this rank, as ``micro_batches``
    micro-batches tagged with their augmentation's stream key (``with_draws``).

    Iteration starts at the first batch rather than when the iterator is created: a fit resumed from a checkpoint
    creates its training iterator before it restores the epoch counter and calls the sampler's set_epoch; worker
    processes would already have drawn the indices of epoch 0. The workers' own random draws (a crop in the
    workers) come from a generator seeded with (data.seed, epoch, rank) at every epoch, so a resumed run draws
    what the uninterrupted one drew: such workers cannot persist across epochs.
    """

    sampler: GlobalBatchSampler  # the sampler it is built with

    def __init__(self, dataset: Dataset[Item], *, micro_batches: int = 1, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.micro_batches, self.rank = micro_batches, rank

    def __len__(self) -> int:
        return super().__len__() * self.micro_batches

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]  # batches, not the dataset's items
        epoch = self.sampler.epoch
        self.sampler.replay_steps = self.position.replay_steps(epoch, self.micro_batches)
        if not self.persistent_workers:
            self.generator = torch.Generator().manual_seed(draw_seed(self.sampler.seed, epoch, self.rank, 2))
        yield from with_draws(super().__iter__(), epoch, self.micro_batches)


class StreamTrainLoader(ResumableLoader):
    """An endless training stream (a ShardStream, or another IterableDataset reading this rank's share) cut into
    epochs of a fixed number of optimiser steps, each of ``micro_batches`` micro-batches tagged with their
    augmentation's stream key (``with_draws``).

    All ranks take the same number of steps (DDP needs it). A ShardStream is told the epoch when it starts, so its
    shard order changes every epoch and follows a resumed run, and replays the batches a resumed epoch had trained.
    Another stream keeps its own order; a resumed epoch reads the batches it had trained and drops them.
    """

    def __init__(
        self,
        dataset: IterableDataset[Any],
        batches_per_epoch: int,
        current_epoch: Callable[[], int],
        *,
        micro_batches: int = 1,
        rank: int = 0,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.batches_per_epoch = batches_per_epoch
        self.current_epoch = current_epoch
        self.micro_batches, self.rank, self.seed = micro_batches, rank, seed

    def __len__(self) -> int:
        return self.batches_per_epoch * self.micro_batches

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]  # batches, not the dataset's items
        # A generator: the epoch is read at the first batch, not when Lightning creates the iterator (a fit
        # resumed from a checkpoint creates it before its epoch counter is restored).
        epoch = self.current_epoch()
        replay = self.position.replay_steps(epoch, self.micro_batches)
        if isinstance(self.dataset, ShardStream):  # its workers replay the trained batches' random draws
            self.dataset.epoch, self.dataset.replay_batches = epoch, replay
            assert self.batch_size is not None  # built with one
            self.dataset.batch_size, replay = self.batch_size, 0
        # the workers' seeds come from (seed, epoch, rank), not from the global generator: creating the iterator
        # draws nothing from it, and a resumed run's workers draw what the uninterrupted run's drew
        self.generator = torch.Generator().manual_seed(draw_seed(self.seed, epoch, self.rank, 2))
        batches: Iterable[Any] = itertools.islice(super().__iter__(), self.batches_per_epoch)
        if replay:  # read and dropped, counted as trained
            batches = ({"replayed": 1} if index < replay else batch for index, batch in enumerate(batches))
        yield from with_draws(batches, epoch, self.micro_batches)


LoadedItem = TypeVar("LoadedItem")


def data_loader(
    dataset: Dataset[LoadedItem],
    batch_size: int,
    loader_cls: type[DataLoader[Any]] = StartCheckedLoader,
    *,
    num_workers: int,
    **kwargs: Any,
) -> DataLoader[LoadedItem]:
    """A loader of the data module's datasets, and of the evaluations' own: no more workers than a shard stream can
    keep busy, the project's collate function, loader workers that leave the job's signals to the training process
    and that are started again where one never started (robust_lightning/data/worker_start.py), pinned memory on
    GPUs."""
    if type(dataset) is ShardStream:  # more workers than shards would sit idle
        num_workers = min(num_workers, len(dataset.urls))
    elif isinstance(dataset, HoldoutStream):  # each worker reads every held-out shard: keep the I/O small
        num_workers = min(num_workers, 2)
    kwargs.setdefault("collate_fn", collate)
    if num_workers > 0:  # the training process handles SIGTERM / SIGUSR1, not its workers
        kwargs.setdefault("worker_init_fn", ignore_job_signals)
    pin_memory = torch.cuda.is_available()
    return loader_cls(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, **kwargs)
