"""Where the images come from: one class per storage format, chosen in the config as ``data.source``.

A source turns the data module's request (which splits, which transforms, which evaluation images, which rank)
into datasets; the data module does everything after that (batches, ranks' loaders, augmentation, reporting). A
new format, such as an LMDB or a Hugging Face dataset, is one new subclass of ``DataSource``; the data module
checks what it builds (``check_built``) and nothing else in the project asks which class it is:

    data:
      source:
        class_path: ShardSource          # or FolderSource, SyntheticSource, or your own module.Class
        init_args:
          train_shards: /datasets/imagenet-wds/train
          val_shards: /datasets/imagenet-wds/val
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeGuard

import torch
import webdataset as wds
from braceexpand import braceexpand
from torch.utils.data import Dataset, IterableDataset, Subset

from robust_lightning.data.classes import class_map as load_class_map
from robust_lightning.data.datasets import (
    SUBSET_ADVICE,
    HoldoutStream,
    LabelledImageFolder,
    ListedImages,
    ReplayableSubset,
    ShardStream,
)
from robust_lightning.data.samplers import ShardShare
from robust_lightning.data.shards import read_manifest, repair_hint, shard_urls
from robust_lightning.data.synthetic import ensure_synthetic_dataset
from robust_lightning.errors import UserError
from robust_lightning.paths import DATA_DIR

HOLDOUT_SEED = 0  # fixed: the selection split must not move with the data-order seed

Transform = Callable[[Any], Any]


@dataclass(frozen=True)
class SetRequest:
    """What the data module asks a source for in ``setup``."""

    training: Transform  # per-image transform of training images
    evaluation: Transform  # per-image transform of evaluation images
    needs_train: bool  # the training split is needed (fit, or validation on held-out training images)
    on_holdout: bool  # validation runs on the held-out training images instead of the val split
    holdout: int  # training images held out for checkpoint selection (data.holdout)
    subset: list[str] | None  # data.eval_subset's ``class_folder/file_name`` entries in order, cut to the limit
    subset_labels: dict[str, int] | None  # the label map the subset's labels must follow (RobustBench: ImageNet's)
    limit: int | None  # data.eval_limit: evaluate only the first n images
    read_damaged: bool  # data.on_missing_images warn: read damaged shards and count what they lack
    shuffle_buffer: int
    seed: int
    rank: int
    world_size: int


@dataclass
class DataSets:
    """What a source builds: this rank's datasets and what is known of them before they are read.

    A map-style set is the whole split (the data module shares it out between ranks) and its length is its count.
    A stream (any ``IterableDataset``) reads this rank's share itself, split between the loader workers (as
    ShardStream does), and its count over all ranks is ``train_images`` / ``eval_images`` where the source reports
    it, else its ``len()`` where it has one."""

    train: Dataset | None = None
    evaluation: Dataset | None = None
    train_images: int | None = None  # training images over all ranks (streams; a map-style set has len)
    eval_images: int | None = None  # evaluation images over all ranks, where known before reading (streams)
    eval_keys: frozenset[str] | None = None  # the sample keys of a listed subset read from shards
    eval_shard_spec: str | None = None  # the shard directory evaluation reads, to name damaged shards

    def training(self) -> tuple[Dataset, int]:
        """The training set and its images over all ranks (``check_built`` made sure the count is known)."""
        assert self.train is not None  # built for fit
        images = images_of(self.train, self.train_images)
        assert images is not None  # check_built refused a training stream of unknown length
        return self.train, images

    def evaluation_images(self) -> int | None:
        """The evaluation images over all ranks, None where they are only known once read (shards given by a
        pattern without a manifest)."""
        return None if self.evaluation is None else images_of(self.evaluation, self.eval_images)


def images_of(dataset: Dataset, reported: int | None) -> int | None:
    """A built set's images over all ranks: a map-style set's length; a stream's reported count, else its length
    where it has one."""
    if isinstance(dataset, IterableDataset) and reported is not None:
        return reported
    try:
        return len(dataset)  # type: ignore[arg-type]  # a Dataset need not define __len__: a stream may not
    except TypeError:
        return None


class DataSource:
    """One storage format of an image classification dataset with a training and a validation split.

    ``build`` applies all of the request itself: the holdout, the evaluation subset and the limit. The data module
    counts what it built against what was requested and refuses a source that left one out (``check_built``).
    Code outside this module asks a source only through these methods, never which class it is."""

    kind: ClassVar[str]  # what results.json and messages call it ("folder", "shards", "synthetic"); never branched on

    def num_classes(self, requested: int | None) -> int:
        """The size of the label space: ``requested`` (data.num_classes) where given, else the source's own."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Work done once per machine before setup (LightningDataModule.prepare_data), e.g. writing files."""

    def build(self, request: SetRequest) -> DataSets:
        """This rank's datasets for ``request``."""
        raise NotImplementedError

    def location(self) -> str | None:
        """Where the evaluation images are read from: the resume identities of saved outcomes record it, so that
        two datasets of one class do not share outcomes; evaluations report it."""
        raise NotImplementedError

    def imagenet_labels(self) -> bool:
        """Whether the labels follow the standard ImageNet class map (so benchmark class lists apply)."""
        return False

    def val_folder(self) -> str | None:
        """The validation split as a folder of image files that a benchmark may read by path (the card's default
        in-distribution images of ImageNet-O), None where the images are not such a folder."""
        return None

    def differences_from_official_code(self) -> list[str]:
        """How reading the training images departs from the official code's ImageFolder read in a full random
        permutation (robust_lightning.official_differences)."""
        return []

    def conditions(self) -> dict[str, Any]:
        """What results.json records about the source."""
        raise NotImplementedError


class FolderSource(DataSource):
    """ImageFolder trees: ``root/train/<wnid>/*.JPEG`` and ``root/val`` (class folders, or flat with ``val_labels``).

    Args:
        root: the directory holding train/ and val/ with one folder per class.
        class_map: "imagenet" (the standard map in data/), "folders" (sorted class folders) or a JSON file.
        val_labels: for a flat ``root/val``, as ImageNet's val is distributed (the images in val/ itself, no class
            folders): the file giving each image's class folder name (WNID), labelled then by ``class_map``:
            Kaggle's LOC_val_solution.csv (``ImageId,PredictionString``, the WNID first in PredictionString), one
            ``<file name> <wnid>`` line per image (a space or a comma between them), or the devkit's
            ILSVRC2012_validation_ground_truth.txt, read with the devkit's meta.mat beside it (its class numbers
            follow the devkit's own class order).
    """

    kind = "folder"

    def __init__(self, root: str, class_map: str = "imagenet", val_labels: str | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise UserError(
                f"data.source.root {root} does not exist; expected ROOT/train/<wnid>/*.JPEG and ROOT/val/..."
            )
        self.class_map, self.val_labels = class_map, val_labels
        self.classes = load_class_map(class_map, self.root / "train" if class_map == "folders" else None)

    def num_classes(self, requested: int | None) -> int:
        return requested or max(self.classes.values()) + 1

    def build(self, request: SetRequest) -> DataSets:
        sets = DataSets()
        if request.needs_train:
            folder = LabelledImageFolder(self._split_dir("train"), self.classes, request.training)
            sets.train = folder
            if request.holdout:
                sets.train, held = self._split_holdout(folder, request)
        if request.on_holdout:
            sets.evaluation = held
        else:
            val = LabelledImageFolder(self._split_dir("val"), self.classes, request.evaluation, self.val_labels)
            sets.evaluation = self._selected(val, request)
        return sets

    def _split_dir(self, split: str) -> Path:
        path = self.root / split
        if not path.is_dir():
            raise UserError(f"{path} does not exist; expected the ImageFolder layout {self.root}/{split}/<wnid>/*.JPEG")
        return path

    @staticmethod
    def _split_holdout(train: LabelledImageFolder, request: SetRequest) -> tuple[Subset, Subset]:
        """A fixed random subset of train (the same in every run and on every rank) becomes the selection split."""
        if request.holdout >= len(train):
            raise UserError(f"data.holdout {request.holdout} must be smaller than the {len(train)} training images")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(HOLDOUT_SEED)).tolist()
        held = copy.copy(train)
        held.transform = request.evaluation
        return ReplayableSubset(train, sorted(order[request.holdout :])), Subset(held, sorted(order[: request.holdout]))

    def _selected(self, dataset: LabelledImageFolder, request: SetRequest) -> Dataset:
        """The subset's images in the subset file's order, or the first ``limit`` images, or all."""
        subset = request.subset
        if subset is None:
            return Subset(dataset, range(min(request.limit, len(dataset)))) if request.limit else dataset
        flat = dataset.file_wnids
        if flat is not None:  # a flat folder: listed images are found by file name, and must be of the listed class
            wrong = [(wnid, name) for wnid, name in (e.split("/") for e in subset) if flat.get(name, wnid) != wnid]
            if wrong:
                wnid, name = wrong[0]
                raise UserError(
                    f"data.eval_subset lists {name} under {wnid}, but data.source.val_labels "
                    f"{dataset.labels_file} labels it {flat[name]} ({len(wrong)} images differ)"
                )
        index = {}
        for i, (path, _) in enumerate(dataset.samples):
            name = Path(path).relative_to(dataset.root).as_posix()
            index[name if flat is None else f"{flat[name]}/{name}"] = i
        missing = [name for name in subset if name not in index]
        if missing:
            layout = "<wnid>/<file name>" if flat is None else "<file name>"
            raise UserError(
                f"{len(missing)} of the {len(subset)} images of data.eval_subset are not in {dataset.root} "
                f"(first: {missing[0]}); expected {dataset.root}/{layout} for every listed image. "
                f"{SUBSET_ADVICE}"
            )
        required = request.subset_labels
        if required is not None:
            classes = {name.split("/")[0] for name in subset}
            wrong_classes = sorted(w for w in classes if dataset.class_to_label.get(w) != required.get(w))
            if wrong_classes:
                first = wrong_classes[0]
                raise UserError(
                    f"data.source.class_map {self.class_map} labels the RobustBench subset's class {first} "
                    f"{dataset.class_to_label.get(first)}, not {required[first]} as the standard ImageNet map "
                    f"does ({len(wrong_classes)} classes differ): its labels follow that map; use class_map imagenet"
                )
        return Subset(dataset, [index[name] for name in subset])

    def location(self) -> str:
        return str(self.root)

    def imagenet_labels(self) -> bool:
        return self.class_map == "imagenet"

    def val_folder(self) -> str:
        return str(self.root / "val")

    def conditions(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "class_map": self.class_map,
            **({"val_labels": self.val_labels} if self.val_labels else {}),
        }


class ShardSource(DataSource):
    """WebDataset shards: every rank reads its own shards, so the ranks' batches are distinct images.

    Args:
        train_shards: a shard directory written by ``robust-lightning shards`` (holding manifest.json), a brace
            pattern like ``/data/train-{000000..001023}.tar``, or a ``pipe:`` URL.
        val_shards: the same for the validation split.
        train_size: number of training images, needed for shards given by pattern (a manifest has it).
    """

    kind = "shards"

    def __init__(self, train_shards: str | None = None, val_shards: str | None = None, train_size: int | None = None):
        if train_shards is None and val_shards is None:
            raise UserError("data.source ShardSource needs train_shards and/or val_shards")
        self.train_shards, self.val_shards, self.train_size = train_shards, val_shards, train_size

    def num_classes(self, requested: int | None) -> int:
        spec = self.val_shards or self.train_shards
        manifest = read_manifest(spec) if is_shard_dir(spec) else None
        return requested or (manifest or {}).get("num_classes") or 1000

    def build(self, request: SetRequest) -> DataSets:
        sets = DataSets()
        train_spec = self.train_shards
        if request.needs_train:
            if train_spec is None:
                raise UserError("training and data.holdout need data.source.train_shards")
            urls, total = resolve_shards(train_spec, self.train_size)
            if total is None:
                raise UserError(
                    f"data.source.train_shards {train_spec} has no manifest.json: set data.source.train_size to the "
                    "number of training images so every rank takes the same number of steps per epoch"
                )
            if request.holdout:
                urls, held_urls, held_images = self._split_holdout(train_spec, urls, request.holdout)
                total -= held_images
            sets.train_images = total
            sets.train = ShardStream(
                ShardShare.of_rank(urls, request.world_size, request.rank),
                request.training,
                repeat=True,
                shuffle_buffer=request.shuffle_buffer,
                seed=request.seed,
            )
        if request.on_holdout:
            sets.eval_images, sets.eval_shard_spec = request.holdout, train_spec
            sets.evaluation = HoldoutStream(
                held_urls, request.evaluation, limit=request.holdout, rank=request.rank, world_size=request.world_size
            )
        else:
            self._build_evaluation(sets, request)
        if request.read_damaged:
            assert isinstance(sets.evaluation, ShardStream)  # every evaluation set of shards is a stream
            sets.evaluation.handler = wds.warn_and_continue
        return sets

    def _build_evaluation(self, sets: DataSets, request: SetRequest) -> None:
        spec = self.val_shards
        if spec is None:
            raise UserError("evaluation needs data.source.val_shards")
        # data.on_missing_images warn: evaluate damaged shards too, and report the images they lack
        urls, sets.eval_images = resolve_shards(spec, None, check_sizes=not request.read_damaged)
        sets.eval_shard_spec = spec
        if request.subset is not None:
            folders = {Path(name).stem.replace(".", "_"): name.split("/")[0] for name in request.subset}
            listed = ListedImages(folders, request.subset_labels)
            sets.eval_images = len(listed.folders)
            # a listed image missing from the shards can only be told after reading them
            sets.eval_keys = frozenset(listed.folders)
            shards = ShardShare.of_rank(urls, request.world_size, request.rank)
            sets.evaluation = ShardStream(shards, request.evaluation, repeat=False, subset=listed)
        elif request.limit:
            # the first n samples of the val shards, split sample by sample over ranks and workers
            sets.eval_images = min(request.limit, sets.eval_images or request.limit)
            sets.evaluation = HoldoutStream(
                urls, request.evaluation, limit=request.limit, rank=request.rank, world_size=request.world_size
            )
        else:
            shards = ShardShare.of_rank(urls, request.world_size, request.rank)
            sets.evaluation = ShardStream(shards, request.evaluation, repeat=False)

    @staticmethod
    def _split_holdout(spec: str, urls: list[str], holdout: int) -> tuple[list[str], list[str], int]:
        """The last training shards (shuffled at conversion) hold the selection split: (train urls, held urls,
        images removed from training). Samples of the held shards beyond ``holdout`` are used by neither."""
        manifest = read_manifest(spec) if is_shard_dir(spec) else None
        if manifest is None:
            raise UserError(
                "data.holdout with shards needs a shard directory with manifest.json (written by "
                "robust-lightning shards), to know how many images each held-out shard holds"
            )
        counts = [s["num_samples"] for s in manifest["shards"]]
        held = 0
        for n_held, count in enumerate(reversed(counts), start=1):  # noqa: B007 - read after the loop
            held += count
            if held >= holdout:
                break
        if held < holdout or n_held == len(counts):
            raise UserError(
                f"data.holdout {holdout} needs fewer images than the training shards hold "
                f"({sum(counts)} in {len(counts)} shards), with at least one shard left for training"
            )
        return urls[:-n_held], urls[-n_held:], held

    def location(self) -> str | None:
        return self.val_shards

    def differences_from_official_code(self) -> list[str]:
        return [
            "training images read from WebDataset shards, shuffled through a buffer "
            "(official: ImageFolder with a full random permutation)"
        ]

    def imagenet_labels(self) -> bool:
        # shards carry the labels they were written with; a pattern without a manifest is taken to be ImageNet's
        spec = self.val_shards or self.train_shards
        manifest = read_manifest(spec) if is_shard_dir(spec) else None
        class_map: str = (manifest or {}).get("class_map", "imagenet")
        return class_map == "imagenet"

    def conditions(self) -> dict[str, Any]:
        return {"train_shards": self.train_shards, "val_shards": self.val_shards}


class SyntheticSource(DataSource):
    """The built-in dataset: procedurally drawn shapes, written as shards under data/ on first use (no download).

    Args:
        num_classes: classes (shapes and colours).
        train_per_class, val_per_class: images per class in each split.
        image_size: side of the written images.
        samples_per_shard: images per shard file.
        root: where the shards are written (default: data/synthetic).
    """

    kind = "synthetic"

    def __init__(
        self,
        num_classes: int = 10,
        train_per_class: int = 600,
        val_per_class: int = 100,
        image_size: int = 64,
        samples_per_shard: int = 500,
        root: str | None = None,
    ):
        self.options: dict[str, Any] = {
            "num_classes": num_classes,
            "train_per_class": train_per_class,
            "val_per_class": val_per_class,
            "image_size": image_size,
            "samples_per_shard": samples_per_shard,
        }
        self.root = Path(root) if root else DATA_DIR / "synthetic"

    def num_classes(self, requested: int | None) -> int:
        classes: int = self.options["num_classes"]  # the written set's, whatever data.num_classes says
        return classes

    def prepare(self) -> None:
        ensure_synthetic_dataset(self.root, **self.options)

    def build(self, request: SetRequest) -> DataSets:
        self.prepare()  # no-op when prepare_data wrote it; covers direct setup() calls
        return ShardSource(str(self.root / "train"), str(self.root / "val")).build(request)

    def location(self) -> str:
        return str(self.root)

    def conditions(self) -> dict[str, Any]:
        return {**self.options, "root": str(self.root)}


def is_shard_dir(spec: str | None) -> TypeGuard[str]:
    """Whether a shard specification names a local directory (which holds a manifest), not a pattern or URL."""
    return spec is not None and not spec.startswith("pipe:") and Path(spec).is_dir()


def resolve_shards(spec: str, size: int | None, check_sizes: bool = True) -> tuple[list[str], int | None]:
    """Shard URLs and the number of images they hold (from the manifest if there is one)."""
    if is_shard_dir(spec):
        manifest = read_manifest(spec)
        return shard_urls(spec, check_sizes), manifest["num_samples"] if manifest else None
    urls = list(braceexpand(spec))
    if not spec.startswith("pipe:"):
        missing = [u for u in urls if not Path(u.removeprefix("file:")).is_file()]
        if missing:
            raise UserError(
                f"{len(missing)} of {len(urls)} shards of {spec} do not exist (first: {missing[0]}); expected "
                "a shard directory with manifest.json, a brace pattern of .tar files, or a pipe: URL"
            )
    return urls, size


def damaged_shards(spec: str | None) -> list[str]:
    """The shards of a shard directory that are missing or whose size differs from their manifest entry, then, if
    there are any, how to rewrite them (the command, where the manifest records it)."""
    if not is_shard_dir(spec):
        return []
    manifest = read_manifest(spec) or {"shards": []}
    damaged = []
    for shard in manifest["shards"]:
        path = Path(spec) / shard["file"]
        if not path.is_file():
            damaged.append(f"{path} (missing)")
        elif "bytes" in shard and path.stat().st_size != shard["bytes"]:
            damaged.append(f"{path} ({path.stat().st_size} of {shard['bytes']} bytes)")
    return [*damaged, repair_hint(spec)] if damaged else []


def read_eval_subset(spec: str | None, limit: int | None) -> list[str] | None:
    """The ``class_folder/file_name`` entries of data.eval_subset in order (cut to ``limit``), or None without one.
    "robustbench" is RobustBench's 5000-image ImageNet subset shipped in data/, anything else a file."""
    if spec is None:
        return None
    path = DATA_DIR / "robustbench_imagenet_test_image_ids.txt" if spec == "robustbench" else Path(spec)
    if not path.is_file():
        raise UserError(f"data.eval_subset {spec}: no file {path}; expected lines class_folder/file_name")
    entries = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    malformed = [e for e in entries if e.count("/") != 1]
    if malformed:
        raise UserError(f"data.eval_subset {path}: lines must read class_folder/file_name, got {malformed[0]!r}")
    return entries[:limit] if limit else entries


def check_built(source: DataSource, request: SetRequest, sets: DataSets) -> None:
    """Refuse what a source built for ``request`` where it left out part of it: a split, the count of a training
    stream, or the holdout, evaluation subset or limit, told by the evaluation images it built (exactly the
    holdout; at most the subset's entries or the limit: a listed image missing from shards is found only when they
    are read, and a split may hold fewer images than the limit). A count known only once read is not checked."""
    name = f"data.source {type(source).__name__}"
    if sets.evaluation is None:
        raise UserError(f"{name} built no evaluation set")
    if request.needs_train:
        if sets.train is None:
            raise UserError(f"{name} built no training set, which {'data.holdout' if request.holdout else 'fit'} needs")
        if images_of(sets.train, sets.train_images) is None:  # the steps per epoch are counted from it
            raise UserError(f"{name} built a training stream that neither reports its images nor has a length")
    images = sets.evaluation_images()
    if images is None:
        return
    if request.on_holdout:
        if images != request.holdout:
            raise UserError(f"{name} ignored data.holdout {request.holdout}: it built {images} evaluation images")
    elif request.subset is not None:
        if images > len(request.subset):
            raise UserError(
                f"{name} ignored data.eval_subset: it built {images} evaluation images for the "
                f"{len(request.subset)} listed"
            )
    elif request.limit is not None and images > request.limit:
        raise UserError(f"{name} ignored data.eval_limit {request.limit}: it built {images} evaluation images")


def training_subset(
    sets: DataSets, fraction: float, max_images: int | None, seed: int
) -> tuple[Dataset, int, int, int]:
    """A fixed random subset of a built training set: (dataset, images, round(fraction x training images),
    training images). A map-style set's subset is a seeded permutation's first images; a shard stream reads its
    shards once in a seeded order (they are shuffled when written) and the first images are kept; another stream's
    first images are kept, in its own order."""
    generator = torch.Generator().manual_seed(seed)
    train, total = sets.training()
    dataset: Dataset = train
    if isinstance(train, ShardStream):
        stream = copy.copy(train)
        stream.repeat, stream.seed = False, seed  # one pass: every image at most once
        stream.urls = [train.urls[i] for i in torch.randperm(len(train.urls), generator=generator)]
        dataset = stream
    subset_images = max(1, round(fraction * total))
    images = min(subset_images, max_images or subset_images)
    if not isinstance(train, IterableDataset):
        dataset = Subset(train, torch.randperm(total, generator=generator)[:images].tolist())
    return dataset, images, subset_images, total
