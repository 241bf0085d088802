"""The datasets the data module reads: ImageFolder trees (with a flat val folder labelled by a file), listed
images, and WebDataset shard streams. An image that cannot be decoded becomes a ``Corrupt`` marker, which the
collate function drops and counts (``robust_lightning.data.loaders``). An image that a fit resumed mid-epoch had
already trained on is replayed: its transform's random draws are made, its pixels are not decoded, and it becomes
a ``Replayed`` marker, whose batch the training loader drops.
"""

import copy
import io
import itertools
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, Subset, get_worker_info
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from robust_lightning.data.classes import VAL_LABELS_FORMATS, label_flat_folder
from robust_lightning.data.samplers import ReplayIndex, ShardShare
from robust_lightning.data.shards import MANIFEST_NAME, Sample, repair_hint
from robust_lightning.data.transforms import ImageTransform, draw_without_decoding
from robust_lightning.errors import UserError

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")


SUBSET_ADVICE = (
    "data.eval_subset lists the images to evaluate (robustbench: RobustBench's 5000 ImageNet val "
    "images); to evaluate every image of this tree instead, set --data.eval_subset null"
)


@dataclass(frozen=True)
class Corrupt:
    """Stands in for a sample whose image could not be decoded; the collate function drops and counts it."""

    key: str
    reason: str


@dataclass(frozen=True)
class Replayed:
    """Stands in for an image that the interrupted attempt of a resumed fit had already trained on in this epoch:
    its transform's random draws were made (so the loader worker's random stream moves on as it did then), its
    pixels were not decoded. The training loader drops the batches of such images."""

    key: str


# A decoded image's sample fields: "image" (and "geometry" for canvases), "label", "key"
Decoded = dict[str, Any]
# What a dataset here gives for one index or stream position (the collate function's input)
Item = Decoded | Corrupt | Replayed
DatasetT = TypeVar("DatasetT")


class ReplayableSubset(Subset[Item]):
    """A Subset (the training images left beside a holdout) that passes a ReplayIndex on as one; torch's Subset
    would hand the dataset a plain index."""

    def __getitem__(self, index: int) -> Item:
        inner = self.indices[index]
        return self.dataset[ReplayIndex(inner) if isinstance(index, ReplayIndex) else inner]

    def __getitems__(self, indices: list[int]) -> list[Item]:
        return [self[index] for index in indices]


def transform_bytes(transform: ImageTransform, data: bytes) -> Decoded:
    """Decode and transform one encoded image into sample fields ("image", and "geometry" for canvases)."""
    out = transform(Image.open(io.BytesIO(data)))
    return out if isinstance(out, dict) else {"image": out}


class LabelledImageFolder(ImageFolder):
    """ImageFolder whose labels come from a fixed class map, so a val tree with missing classes keeps the
    standard ImageNet labels; undecodable images become Corrupt markers instead of exceptions.

    With ``labels_file`` (data.source.val_labels) the folder is flat, as ImageNet's val is distributed: the images
    lie in ``root`` itself and the file gives each one's class folder name (``classes.read_val_labels``);
    ``file_wnids`` then maps each file name to it."""

    def __init__(
        self,
        root: str | Path,
        class_to_label: dict[str, int],
        transform: ImageTransform,
        labels_file: str | None = None,
    ) -> None:
        self.class_to_label, self.labels_file = class_to_label, labels_file
        self.file_wnids: dict[str, str] | None = None
        super().__init__(str(root), transform=transform, allow_empty=True)
        if not self.samples:
            raise UserError(f"no images found under {root}; expected {root}/<class folder>/<image files>")
        # A sample's key is its file name's stem (ImageNet's are unique; AutoAttack outcomes and predictions are
        # keyed by it); where stems repeat across class folders (0001.png in every class), its path without the
        # extension, so that no two images share a key.
        stems = [Path(path).stem for path, _ in self.samples]
        self.keys = (
            stems
            if len(set(stems)) == len(stems)
            else [Path(path).relative_to(self.root).with_suffix("").as_posix() for path, _ in self.samples]
        )

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        loose = sorted(
            entry.name
            for entry in os.scandir(directory)
            if entry.is_file()
            and not entry.name.startswith(".")
            and has_file_allowed_extension(entry.name, IMG_EXTENSIONS)
        )
        if self.labels_file is not None or loose:
            return self._flat_classes(directory, loose)
        folders = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
        unknown = [name for name in folders if name not in self.class_to_label]
        if unknown:
            raise UserError(
                f"{directory}: class folders {unknown[:5]}{' ...' if len(unknown) > 5 else ''} are not in the "
                "class map; ImageNet needs WordNet-id folders (e.g. n01440764), other datasets class_map: folders"
            )
        return folders, {name: self.class_to_label[name] for name in folders}

    def _flat_classes(self, directory: str, images: list[str]) -> tuple[list[str], dict[str, int]]:
        if self.labels_file is None:
            raise UserError(
                f"{directory} holds images directly (e.g. {images[0]}) instead of class folders "
                f"<wnid>/<images>; a flat val folder (ImageNet's val as distributed) needs its labels: "
                f"set data.source.val_labels to {VAL_LABELS_FORMATS}"
            )
        if not images:
            raise UserError(
                f"data.source.val_labels {self.labels_file} labels a flat folder of images, but {directory} "
                "holds none directly; for class folders <wnid>/<images> leave data.source.val_labels out"
            )
        self.file_wnids = label_flat_folder(
            directory, images, self.labels_file, self.class_to_label, "data.source.val_labels"
        )
        wnids = sorted(set(self.file_wnids.values()))
        return wnids, {name: self.class_to_label[name] for name in wnids}

    def make_dataset(
        self,
        directory: str,
        class_to_idx: dict[str, int],
        extensions: tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
    ) -> list[tuple[str, int]]:
        if self.file_wnids is None:
            found: list[tuple[str, int]] = super().make_dataset(
                directory, class_to_idx, extensions, is_valid_file, allow_empty
            )
            return found
        return [(os.path.join(directory, name), class_to_idx[wnid]) for name, wnid in self.file_wnids.items()]

    def __getitem__(self, index: int) -> Item:
        path, label = self.samples[index]
        try:
            with open(path, "rb") as f:
                if isinstance(index, ReplayIndex):  # the header is read, for the image's size
                    draw_without_decoding(self.transform, Image.open(f))
                    return Replayed(self.keys[index])
                fields = transform_bytes(self.transform, f.read())
        except Exception as e:  # any failure to read or decode means this one image is unusable
            return Corrupt(path, f"{type(e).__name__}: {e}")
        return {**fields, "label": label, "key": self.keys[index]}


@dataclass(frozen=True)
class ListedImages:
    """An evaluation subset read from shards: each listed image's class folder by sample key, and the label map
    the shards' labels must follow (None: not checked)."""

    folders: dict[str, str]
    labels: dict[str, int] | None

    def check(self, sample: Sample, label: int) -> None:
        """A shard sample of another class than listed, or labelled by another map, is an error, not a skip:
        it means the shards do not hold the listed images or their labels are not the subset's."""
        key, where = sample["__key__"], sample.get("__url__", "?")
        listed = self.folders[key]
        wnid = sample["wnid"].decode() if isinstance(sample.get("wnid"), bytes) else sample.get("wnid")
        if wnid is not None and wnid != listed:
            raise UserError(
                f"{where}:{key} is of class {wnid}, but data.eval_subset lists it under {listed}: "
                f"these shards do not hold the listed images. {SUBSET_ADVICE}"
            )
        if self.labels is not None and self.labels.get(listed) != label:
            raise UserError(
                f"{where}:{key} ({listed}) has label {label} but {self.labels.get(listed)} in the standard ImageNet "
                "map, which the RobustBench subset's labels follow: write the val shards with class_map imagenet"
            )


def stop_at_unreadable_shard(exn: Exception) -> bool:
    """webdataset handler: a shard that cannot be read to its end (truncated, not a tar file) stops the run
    with its name, instead of silently leaving its remaining samples out of the metrics or the training."""
    if isinstance(exn, UserError):  # ours, raised from an inner webdataset loop: drop what the outer one appended
        exn.args = exn.args[:1]
        raise exn
    reason = exn.args[0] if exn.args else type(exn).__name__
    # webdataset appends the shard's URL to the arguments of the exceptions it passes on, or, for a member it
    # cannot read, the open file (" @ <_io.BufferedReader name='...'>") to the message
    url = next((arg for arg in reversed(exn.args[1:]) if isinstance(arg, str)), None)
    if url is None and (opened := re.search(r" @ <.*name='([^']+)'>$", str(reason))):
        url = opened.group(1)
    directory = Path(url.removeprefix("file:")).parent if url and not url.startswith("pipe:") else None
    if directory is not None and (directory / MANIFEST_NAME).is_file():
        repair = repair_hint(directory)
    else:
        repair = "re-create it with robust-lightning shards"
    raise UserError(
        f"cannot read shard ({type(exn).__name__}: {reason}): {url or 'it'} is truncated or not a tar file; {repair}"
    ) from exn


class ShardStream(IterableDataset[Item]):
    """Decoded samples from one rank's shards, split between the DataLoader workers.

    With ``repeat`` (training) the stream is endless: each pass reshuffles the shard order with a seed of
    (seed, epoch, pass), so workers stay disjoint and epochs differ; StreamTrainLoader cuts it into epochs.
    Without ``repeat`` (evaluation) every shard is read exactly once.

    A resumed epoch replays (``Replayed``) the samples of its first ``replay_batches`` batches of ``batch_size``,
    over all workers: the DataLoader takes batch b from worker b % workers, each worker's batches in its own order.
    """

    def __init__(
        self,
        urls: list[str] | ShardShare,
        transform: ImageTransform,
        *,
        repeat: bool,
        shuffle_buffer: int = 0,
        seed: int = 0,
        subset: ListedImages | None = None,
    ) -> None:
        share = urls if isinstance(urls, ShardShare) else ShardShare(list(urls))
        self.urls = share.urls
        self.readers, self.reader = share.readers, share.reader  # ranks sharing these shards split their samples
        self.transform = transform
        self.subset = subset  # evaluate only these samples (an evaluation subset); None: all
        self.repeat = repeat
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.epoch = 0  # set by StreamTrainLoader in the main process before workers start
        self.replay_batches, self.batch_size = 0, 1  # likewise, for a resumed epoch
        # an unreadable shard stops the run; data.on_missing_images warn reads on and counts what is missing
        self.handler = stop_at_unreadable_shard

    def _worker_urls(self, worker: int, num_workers: int) -> Iterator[dict[str, str]]:
        for repetition in itertools.count():
            order = list(self.urls)
            if self.repeat:
                random.Random(f"{self.seed}-{self.epoch}-{repetition}").shuffle(order)
            mine = order[worker::num_workers]
            if not mine:
                return
            yield from ({"url": url} for url in mine)
            if not self.repeat:
                return

    def __iter__(self) -> Iterator[Item]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        samples = wds.tarfile_samples(self._worker_urls(worker, num_workers), handler=self.handler)
        if self.readers > 1:  # a shard shared with other ranks (then the only one, read by one worker)
            samples = itertools.islice(samples, self.reader, None, self.readers)
        if self.shuffle_buffer > 1:
            rng = random.Random(f"{self.seed}-{self.epoch}-{worker}")
            samples = wds.shuffle(self.shuffle_buffer, min(100, self.shuffle_buffer), rng=rng)(samples)
        replayed = len(range(worker, self.replay_batches, num_workers)) * self.batch_size  # this worker's samples
        for number, sample in enumerate(samples):
            if number < replayed:
                yield self.replay(sample)
            elif self.subset is None:
                yield self.decode(sample)
            elif sample.get("__key__") in self.subset.folders:
                decoded = self.decode(sample)
                if not isinstance(decoded, Corrupt):
                    self.subset.check(sample, decoded["label"])
                yield decoded

    @staticmethod
    def _fields(sample: Sample) -> tuple[str, str, int] | Corrupt:
        """(where, image field, label) of a shard sample, or why it is unusable."""
        where = f"{sample.get('__url__', '?')}:{sample.get('__key__', '?')}"
        field = next((f for f in IMAGE_FIELDS if f in sample), None)
        if field is None:
            return Corrupt(where, "no image field")
        try:
            return where, field, int(sample["cls"])
        except (KeyError, ValueError):
            return Corrupt(where, "missing or invalid 'cls' label")

    def decode(self, sample: Sample) -> Decoded | Corrupt:
        checked = self._fields(sample)
        if isinstance(checked, Corrupt):
            return checked
        where, field, label = checked
        try:
            fields = transform_bytes(self.transform, sample[field])
        except Exception as e:  # any decode failure means this one image is unusable
            return Corrupt(where, f"{type(e).__name__}: {e}")
        return {**fields, "label": label, "key": sample.get("__key__", "?")}

    def replay(self, sample: Sample) -> Replayed | Corrupt:
        """A sample the resumed epoch had trained on: its transform's draws from its header (see ``Replayed``)."""
        checked = self._fields(sample)
        if isinstance(checked, Corrupt):
            return checked
        where, field, _ = checked
        try:
            draw_without_decoding(self.transform, Image.open(io.BytesIO(sample[field])))
        except Exception as e:  # an unreadable header: the decode failed there too, before any draw
            return Corrupt(where, f"{type(e).__name__}: {e}")
        return Replayed(sample.get("__key__", "?"))


class HoldoutStream(ShardStream):
    """The first ``limit`` samples of some training shards, split sample by sample across ranks and workers.

    The held-out selection split is small (4000 images on ImageNet) and may come from fewer shards than there
    are ranks, so each (rank, worker) reads all of its shards and keeps every n-th sample: exact and disjoint.
    """

    def __init__(self, urls: list[str], transform: ImageTransform, *, limit: int, rank: int, world_size: int) -> None:
        super().__init__(urls, transform, repeat=False)
        self.limit, self.rank, self.world_size = limit, rank, world_size

    def __iter__(self) -> Iterator[Item]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        readers = self.world_size * num_workers
        mine = self.rank * num_workers + worker
        samples = wds.tarfile_samples(({"url": url} for url in self.urls), handler=self.handler)
        for index, sample in enumerate(itertools.islice(samples, self.limit)):
            if index % readers == mine:
                yield self.decode(sample)


def with_transform(dataset: DatasetT, transform: ImageTransform | None) -> DatasetT:
    """A copy of a dataset (an image folder, a subset of one, a shard stream) whose images go through another
    per-image transform; the dataset itself is left as it is."""
    dataset = copy.copy(dataset)
    inner: Any = dataset  # the dataset whose transform is swapped: an image folder or a shard stream
    if isinstance(dataset, Subset):  # a folder subset or limit: swap the transform of a copy of the folder
        inner = dataset.dataset = copy.copy(dataset.dataset)
    inner.transform = transform
    return dataset
