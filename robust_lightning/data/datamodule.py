"""ImageNet-style data from three sources: ImageFolder roots, WebDataset shards, or the built-in synthetic set.

Distribution across ranks is decided here, not by Lightning, because Lightning's default is wrong for us
twice over: its validation DistributedSampler pads ranks with repeated samples (double counting), and
webdataset's split_by_node does not split under spawn-started workers (webdataset 1.0.2's split_by_node reads the rank
from the environment). The rank and world size are captured in setup() and every rank reads a disjoint part of the data.
"""

import copy
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import webdataset as wds
from braceexpand import braceexpand
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from robust_lightning.data.augment import BatchAugment
from robust_lightning.data.classes import class_map as load_class_map
from robust_lightning.data.contract import EvaluationSource, TrainingSample
from robust_lightning.data.crop import random_resized_crop
from robust_lightning.data.datasets import (
    SUBSET_ADVICE,
    HoldoutStream,
    LabelledImageFolder,
    ListedImages,
    ReplayableSubset,
    ShardStream,
)
from robust_lightning.data.loaders import EpochLoader, ShardTrainLoader, TrainingPosition, collate, draw_seed
from robust_lightning.data.samplers import ExactDistributedSampler, GlobalBatchSampler, ShardShare, rank_share
from robust_lightning.data.shards import read_manifest, repair_hint, shard_urls
from robust_lightning.data.synthetic import ensure_synthetic_dataset
from robust_lightning.data.transforms import (
    EVAL_RESIZES,
    CanvasDecode,
    default_canvas_size,
    describe_eval_preprocessing,
    eval_transform,
    train_transform,
)
from robust_lightning.errors import UserError
from robust_lightning.official_differences import data_differences
from robust_lightning.paths import DATA_DIR
from robust_lightning.scale.srun import ignore_job_signals

HOLDOUT_SEED = 0  # fixed: the selection split must not move with the data-order seed


@dataclass
class SyntheticData:
    """The built-in dataset: procedurally drawn shapes, generated into shards under data/ on first use."""

    num_classes: int = 10
    train_per_class: int = 600
    val_per_class: int = 100
    image_size: int = 64
    samples_per_shard: int = 500
    root: str | None = None  # default: data/synthetic


class ImageNetDataModule(LightningDataModule):
    """ImageNet-style classification data for training and evaluation. Evaluations use it only through
    ``EvaluationData``: ``image_size``, ``crop_pct``, ``num_workers`` and the methods listed there.

    Args:
        source: "synthetic" (built in, no download), "folder" (ImageFolder roots ``root/train``,
            ``root/val``) or "shards" (WebDataset shards).
        root: for source "folder", the directory holding train/ and val/ with one folder per class.
        train_shards: for source "shards", a shard directory written by ``robust-lightning shards`` (holding
            manifest.json), a brace pattern like ``/data/train-{000000..001023}.tar``, or a ``pipe:`` URL.
        val_shards: the same for the validation split.
        train_size: number of training images, needed for shards given by pattern (a manifest has it).
        num_classes: size of the label space; defaults to the class map's (1000 for ImageNet).
        class_map: "imagenet" (the standard map in data/), "folders" (sorted class folders) or a JSON file.
        val_labels: for source "folder" whose ``root/val`` is flat, as ImageNet's val is distributed (the images
            in val/ itself, no class folders): the file giving each image's class folder name (WNID), labelled
            then by ``class_map``: Kaggle's LOC_val_solution.csv (``ImageId,PredictionString``, the WNID first in
            PredictionString), one ``<file name> <wnid>`` line per image (a space or a comma between them), or
            the devkit's ILSVRC2012_validation_ground_truth.txt, read with the devkit's meta.mat beside it (its
            class numbers follow the devkit's own class order).
        image_size: training crop and evaluation crop r.
        crop_pct: evaluation resizes the shorter side to floor(r / crop_pct) before the centre crop.
        eval_resize: "shorter_side" (the above) or "whole": the whole image resized to r x r, aspect ratio
            ignored, no crop, as Bhojanapalli et al. 2021 evaluate (App. A, "Image Preprocessing").
        augmentation: training augmentation scheme: "basic" (RandomResizedCrop), "3aug" (+ flip and colour jitter
            0.4: Singh et al.'s 3-Aug, App. D.2), "deit3" (+ flip and DeiT-III 3-Augment with colour jitter 0.3)
            or "heavy" (+ flip, RandAugment m9 mstd0.5 per image, RandomErasing 0.25, MixUp 0.8 / CutMix 1.0);
            see robust_lightning.data.augment.
        augment_on: where the training augmentation runs: "device" (the accelerator, after the batch is
            transferred: RandomResizedCrop included, so the CPU workers only decode) or "cpu" (crop and
            per-image augmentation in the loader workers; MixUp/CutMix still on the device).
        augmentation_fill: RandAugment's fill colour and RandomErasing's noise: "imagenet" (timm's ImageNet
            defaults: the mean colour, noise mean + std * N(0, 1) clamped to [0, 1]) or "official" (the code of
            Singh et al., whose timm transform has mean 0 / std 1: black fill, N(0, 1) noise never clamped, so
            erased pixels leave [0, 1]). With augment_on "cpu" the erasing runs on the device with the mixing, in
            float as in timm, so the noise is not rounded to uint8.
        full_resolution_decode: decode every training image at full resolution and random-resized-crop it with
            PIL in the loader workers, as the official pipeline does (torchvision's RandomResizedCrop on the full
            image), instead of the reduced decode of canvases (see canvas_size); the augmentation after the crop
            still runs where augment_on says. augment_on "cpu" always decodes at full resolution.
        crop_scale: area range of RandomResizedCrop.
        canvas_size: with augment_on "device", workers decode each training image into a canvas of this side
            (default 16/7 of image_size: 512 for 224) and ship it whole; larger images are decoded at reduced
            scale to fit (JPEG DCT scaling by 2, 4 or 8; benchmarks/decode_scale.py measures what that changes in
            the crops). Crop boxes are still drawn on the original size.
        eval_subset: evaluate (test/predict, and validate without holdout) only the images listed in a file of
            ``class_folder/file_name`` lines, in its order: "robustbench" is the RobustBench 5000-image ImageNet
            subset (data/robustbench_imagenet_test_image_ids.txt), anything else a path. Folder trees are read
            in the file's order; shards are filtered by sample key (the file name's stem) in stream order, and
            each image must be of the class the file lists. The RobustBench subset's labels must be ImageNet's
            (data.class_map imagenet, shards written with it): anything else is an error.
        eval_limit: evaluate only the first n images (of the subset, if one is set).
        holdout: training images held out for checkpoint selection (the paper holds out 4000 ImageNet train
            images, disjoint from the evaluation images). When > 0, validation runs on them instead of the
            val split and training never sees them; test and predict still use the val split.
        label_smoothing: smoothing of the MixUp/CutMix soft targets (linked from model.label_smoothing).
        batch_size: per-device training batch size.
        global_batch_size: the effective batch over all devices and nodes (the paper's recipes fix it); when
            set, it is split over the devices as evenly as possible (batch_size becomes this rank's share: the
            first global_batch_size % world size ranks take one image more) and the training loss is weighted
            so that the update is that of the mean loss over the whole global batch (ImageClassifier).
        max_device_batch_size: images per forward pass on one device during training. A rank's share of the
            global batch that is larger is split into micro-batches (sizes differing by at most one) whose
            gradients are accumulated (the data module sets trainer.accumulate_grad_batches), so that every
            optimiser step still sees exactly the global batch: the paper's batch on any number of devices with
            any memory. None: one forward per step. trainer.accumulate_grad_batches together with
            data.global_batch_size or this option is refused.
        eval_batch_size: per-device evaluation batch size (default: batch_size).
        num_workers: decoding processes per device.
        shuffle_buffer: samples held for shuffling within the training shard stream.
        seed: data order and augmentation seed (shard order, shuffle buffer, sampler; every training batch's
            augmentation draws from streams keyed by (seed, epoch, batch index, rank), so ranks draw differently
            and a run resumed at an epoch boundary draws what the uninterrupted one drew).
        on_missing_images: what a validation or test epoch that read fewer images than the evaluation set holds
            (a truncated or missing shard, a listed image absent from the shards) does: "error" (stop with the
            expected and read counts and the damaged shards) or "warn" (warn; the counts go to results.json and
            the logged metrics as <stage>/expected_images and <stage>/missing_images). An undecodable image was
            read: it is counted in <stage>/corrupt_images, not as missing.
        synthetic: options of the built-in dataset.
    """

    def __init__(
        self,
        source: Literal["synthetic", "folder", "shards"] = "synthetic",
        root: str | None = None,
        train_shards: str | None = None,
        val_shards: str | None = None,
        train_size: int | None = None,
        num_classes: int | None = None,
        class_map: str = "imagenet",
        val_labels: str | None = None,
        image_size: int = 224,
        crop_pct: float = 0.875,
        eval_resize: Literal["shorter_side", "whole"] = "shorter_side",
        augmentation: Literal["basic", "3aug", "deit3", "heavy"] = "basic",
        augment_on: Literal["device", "cpu"] = "device",
        augmentation_fill: Literal["imagenet", "official"] = "imagenet",
        full_resolution_decode: bool = False,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        canvas_size: int | None = None,
        eval_subset: str | None = None,
        eval_limit: int | None = None,
        holdout: int = 0,
        label_smoothing: float = 0.1,
        batch_size: int = 128,
        global_batch_size: int | None = None,
        max_device_batch_size: int | None = None,
        eval_batch_size: int | None = None,
        num_workers: int = 8,
        shuffle_buffer: int = 5000,
        seed: int = 0,
        on_missing_images: Literal["error", "warn"] = "error",
        synthetic: SyntheticData = SyntheticData(),  # noqa: B008 - a default --print_config shows; read, never mutated
    ):
        super().__init__()
        # Plain attributes, not save_hyperparameters(): checkpoints must load with weights_only=True, which
        # refuses the dataclass; the full config is saved beside the run as config.yaml anyway.
        self.source = source
        self.root = Path(root) if root else None
        self.train_shards, self.val_shards, self.train_size = train_shards, val_shards, train_size
        self.class_map = class_map
        if val_labels is not None and source != "folder":
            raise UserError(
                f"data.val_labels labels a flat val folder of data.source folder, not {source!r} data "
                "(shards of a flat folder hold their labels: robust-lightning shards --val_labels FILE)"
            )
        self.val_labels = val_labels
        self.image_size, self.crop_pct = image_size, crop_pct
        if eval_resize not in EVAL_RESIZES:
            raise UserError(f"data.eval_resize must be one of {', '.join(EVAL_RESIZES)}, got {eval_resize!r}")
        self.eval_resize = eval_resize
        self.augmentation, self.augment_on, self.crop_scale = augmentation, augment_on, tuple(crop_scale)
        self.augmentation_fill, self.full_resolution_decode = augmentation_fill, full_resolution_decode
        self.canvas_size = canvas_size or default_canvas_size(image_size)
        if self.canvas_size < image_size:
            raise UserError(f"data.canvas_size {canvas_size} must be at least data.image_size {image_size}")
        self.holdout, self.label_smoothing = holdout, label_smoothing
        self.eval_subset, self.eval_limit = eval_subset, eval_limit
        if eval_limit is not None and eval_limit < 1:
            raise UserError(f"data.eval_limit must be a positive number of images, got {eval_limit}")
        if holdout < 0:
            raise UserError(f"data.holdout must be >= 0, got {holdout}")
        self.batch_size, self.global_batch_size = batch_size, global_batch_size
        if max_device_batch_size is not None and max_device_batch_size < 1:
            raise UserError(
                f"data.max_device_batch_size must be a positive number of images, got {max_device_batch_size}"
            )
        self.max_device_batch_size = max_device_batch_size
        self.micro_batches = 1  # forward passes per optimiser step on each device (set by setup)
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        if on_missing_images not in ("error", "warn"):
            raise UserError(f"data.on_missing_images must be 'error' or 'warn', got {on_missing_images!r}")
        self.on_missing_images = on_missing_images
        self.synthetic = synthetic
        self.rank, self.world_size = 0, 1
        self._draw_generators: dict[torch.device, torch.Generator] = {}
        self.training_position = TrainingPosition()  # checkpoint state of the training loaders (resuming mid-epoch)
        self.worker_augment = self.device_augment = None
        self.train_set = self.eval_set = None
        self.train_images = self.eval_images = None
        self.eval_keys: frozenset[str] | None = None
        self.eval_shard_spec: str | None = None  # the shard directory evaluation reads, to name damaged shards

        if source == "folder":
            if root is None:
                raise UserError("data.source 'folder' needs data.root: a directory holding train/ and val/")
            if not self.root.is_dir():
                raise UserError(f"data.root {root} does not exist; expected ROOT/train/<wnid>/*.JPEG and ROOT/val/...")
            self.classes = load_class_map(class_map, self.root / "train" if class_map == "folders" else None)
            self.num_classes = num_classes or max(self.classes.values()) + 1
        elif source == "shards":
            if train_shards is None and val_shards is None:
                raise UserError("data.source 'shards' needs data.train_shards and/or data.val_shards")
            manifest = read_manifest(val_shards or train_shards) if _is_dir(val_shards or train_shards) else None
            self.num_classes = num_classes or (manifest or {}).get("num_classes") or 1000
        else:
            self.num_classes = synthetic.num_classes

    # ----------------------------------------------------------------------------------------------- setup
    @property
    def synthetic_root(self) -> Path:
        return Path(self.synthetic.root) if self.synthetic.root else DATA_DIR / "synthetic"

    def prepare_data(self) -> None:
        if self.source == "synthetic":
            self._ensure_synthetic()

    def _ensure_synthetic(self) -> Path:
        s = self.synthetic
        return ensure_synthetic_dataset(
            self.synthetic_root,
            num_classes=s.num_classes,
            train_per_class=s.train_per_class,
            val_per_class=s.val_per_class,
            image_size=s.image_size,
            samples_per_shard=s.samples_per_shard,
        )

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if self.global_batch_size:
            if self.global_batch_size < self.world_size:
                raise UserError(
                    f"data.global_batch_size {self.global_batch_size} leaves some of the {self.world_size} devices "
                    "without an image; use a global batch of at least one image per device"
                )
            self.batch_size = rank_share(self.global_batch_size, self.world_size, self.rank)
        self.micro_batches = self._micro_batches()
        if stage == "fit" and self.trainer is not None:
            self._accumulate_over_micro_batches()
        evaluation = eval_transform(self.image_size, self.crop_pct, self.eval_resize)
        if self.uses_canvases:
            training = CanvasDecode(self.canvas_size)
        else:
            training = train_transform(self.image_size, self.crop_scale)
        self._setup_augmentation()
        # validation of fit and validate runs on the held-out part of train when there is one
        on_holdout = self.holdout > 0 and stage in ("fit", "validate")
        build = {
            "folder": self._build_folder_sets,
            "synthetic": self._build_synthetic_sets,
            "shards": self._build_shard_sets,
        }[self.source]
        build(training, evaluation, needs_train=stage == "fit" or on_holdout, on_holdout=on_holdout)

    def _micro_batches(self) -> int:
        """Forward passes per optimiser step: the fewest that keep every rank's micro-batches within
        max_device_batch_size (ranks' shares differ by at most one image; all ranks take as many passes)."""
        if self.max_device_batch_size is None:
            return 1
        shares = [rank_share(self.global_batch, self.world_size, r) for r in range(self.world_size)]
        passes = math.ceil(max(shares) / self.max_device_batch_size)
        if min(shares) < passes:
            raise UserError(
                f"data.max_device_batch_size {self.max_device_batch_size} splits the smallest share of "
                f"the global batch ({min(shares)} images) into {passes} micro-batches, some empty; "
                "use a larger data.max_device_batch_size"
            )
        return passes

    def _accumulate_over_micro_batches(self) -> None:
        """The trainer accumulates the gradients of a step's micro-batches; its own accumulate_grad_batches would
        multiply the global batch (the paper's recipes fix it), so it is refused where the global batch is ours."""
        accumulate = getattr(self.trainer, "accumulate_grad_batches", 1)
        if (self.global_batch_size or self.max_device_batch_size) and accumulate not in (1, self.micro_batches):
            raise UserError(
                f"trainer.accumulate_grad_batches {accumulate} would multiply data.global_batch_size: "
                "every optimiser step already sees exactly the global batch; to fit it into less "
                "memory, set data.max_device_batch_size (images per forward pass on one device) instead"
            )
        self.trainer.accumulate_grad_batches = self.micro_batches

    # ------------------------------------------------------------------------------ one builder per source
    def _build_folder_sets(self, training, evaluation, *, needs_train: bool, on_holdout: bool) -> None:
        if needs_train:
            train = LabelledImageFolder(self._split_dir("train"), self.classes, training)
            if self.holdout:
                train, held = self._split_folder_holdout(train, evaluation)
            self.train_set = train
        if on_holdout:
            self.eval_set = held
        else:
            val = LabelledImageFolder(self._split_dir("val"), self.classes, evaluation, labels_file=self.val_labels)
            self.eval_set = self._folder_subset(val)

    def _build_synthetic_sets(self, training, evaluation, *, needs_train: bool, on_holdout: bool) -> None:
        root = self._ensure_synthetic()  # no-op when prepare_data made it; covers direct setup() calls
        self._build_shard_sets(
            training,
            evaluation,
            needs_train=needs_train,
            on_holdout=on_holdout,
            train_spec=str(root / "train"),
            val_spec=str(root / "val"),
        )

    def _build_shard_sets(
        self,
        training,
        evaluation,
        *,
        needs_train: bool,
        on_holdout: bool,
        train_spec: str | None = None,
        val_spec: str | None = None,
    ) -> None:
        train_spec, val_spec = train_spec or self.train_shards, val_spec or self.val_shards
        if needs_train:
            if train_spec is None:
                raise UserError("training and data.holdout need data.train_shards")
            urls, total = self._resolve_shards(train_spec, self.train_size)
            if total is None:
                raise UserError(
                    f"data.train_shards {train_spec} has no manifest.json: set data.train_size to the number "
                    "of training images so every rank takes the same number of steps per epoch"
                )
            if self.holdout:
                urls, held_urls, held_images = self._split_shard_holdout(train_spec, urls)
                total -= held_images
            self.train_images = total
            self.train_set = ShardStream(
                self._rank_shards(urls),
                training,
                repeat=True,
                shuffle_buffer=self.shuffle_buffer,
                seed=self.seed,
            )
        if on_holdout:
            self.eval_images, self.eval_shard_spec = self.holdout, train_spec
            self.eval_set = HoldoutStream(
                held_urls, evaluation, limit=self.holdout, rank=self.rank, world_size=self.world_size
            )
        else:
            self._build_shard_eval_set(val_spec, evaluation)
        if self.on_missing_images == "warn":
            self.eval_set.handler = wds.warn_and_continue

    def _build_shard_eval_set(self, val_spec: str | None, evaluation) -> None:
        if val_spec is None:
            raise UserError("evaluation needs data.val_shards")
        # data.on_missing_images warn: evaluate damaged shards too, and report the images they lack
        urls, self.eval_images = self._resolve_shards(val_spec, None, check_sizes=self.on_missing_images == "error")
        self.eval_shard_spec = val_spec
        subset = self._subset_files()
        if subset is not None:
            listed = ListedImages(
                {Path(name).stem.replace(".", "_"): name.split("/")[0] for name in subset}, self._robustbench_labels()
            )
            self.eval_images = len(listed.folders)
            # a listed image missing from the shards can only be told after reading them
            self.eval_keys = frozenset(listed.folders)
            self.eval_set = ShardStream(self._rank_shards(urls), evaluation, repeat=False, subset=listed)
        elif self.eval_limit:
            # the first n samples of the val shards, split sample by sample over ranks and workers
            self.eval_images = min(self.eval_limit, self.eval_images or self.eval_limit)
            self.eval_set = HoldoutStream(
                urls, evaluation, limit=self.eval_limit, rank=self.rank, world_size=self.world_size
            )
        else:
            self.eval_set = ShardStream(self._rank_shards(urls), evaluation, repeat=False)

    def _setup_augmentation(self) -> None:
        """Everything after the crop: on the device by default, or in the workers with MixUp/CutMix (which
        needs the whole batch's labels) still on the device."""
        scheme = self.augmentation
        options = dict(
            flip=scheme != "basic",
            label_smoothing=self.label_smoothing,  # the paper's basic = crop only
            augmentation_fill=self.augmentation_fill,
        )
        self.worker_augment = None
        self.device_augment = BatchAugment(scheme, self.num_classes, **options)
        if self.augment_on == "cpu":
            # RandomErasing goes to the device with the mixing: timm erases float tensors, and the official
            # noise leaves [0, 1], which the workers' uint8 batches cannot carry.
            self.worker_augment = BatchAugment(scheme, self.num_classes, **options, mix=False, erase_prob=0)
            heavy = scheme == "heavy"
            self.device_augment = (
                BatchAugment(
                    "heavy",
                    self.num_classes,
                    flip=False,
                    rand_augment="",
                    mix=True,
                    label_smoothing=self.label_smoothing,
                    augmentation_fill=self.augmentation_fill,
                )
                if heavy
                else None
            )

    @property
    def uses_canvases(self) -> bool:
        """Training images decoded into canvases (reduced scale when large) and cropped on the device."""
        return self.augment_on == "device" and not self.full_resolution_decode

    def _subset_files(self) -> list[str] | None:
        """The evaluation subset's ``class_folder/file_name`` entries in order (cut to eval_limit), or None."""
        if self.eval_subset is None:
            return None
        path = (
            DATA_DIR / "robustbench_imagenet_test_image_ids.txt"
            if self.eval_subset == "robustbench"
            else Path(self.eval_subset)
        )
        if not path.is_file():
            raise UserError(
                f"data.eval_subset {self.eval_subset}: no file {path}; expected lines class_folder/file_name"
            )
        entries = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        malformed = [e for e in entries if e.count("/") != 1]
        if malformed:
            raise UserError(f"data.eval_subset {path}: lines must read class_folder/file_name, got {malformed[0]!r}")
        return entries[: self.eval_limit] if self.eval_limit else entries

    def _robustbench_labels(self) -> dict[str, int] | None:
        """The label map the evaluation subset's labels must follow: ImageNet's for the RobustBench subset (its
        models and numbers use it), none for other subsets."""
        return load_class_map("imagenet") if self.eval_subset == "robustbench" else None

    def _folder_subset(self, dataset: LabelledImageFolder) -> Dataset:
        """The subset's images in the subset file's order, or the first eval_limit images, or all."""
        subset = self._subset_files()
        if subset is None:
            return Subset(dataset, range(min(self.eval_limit, len(dataset)))) if self.eval_limit else dataset
        flat = dataset.file_wnids
        if flat is not None:  # a flat folder: listed images are found by file name, and must be of the listed class
            wrong = [(wnid, name) for wnid, name in (e.split("/") for e in subset) if flat.get(name, wnid) != wnid]
            if wrong:
                wnid, name = wrong[0]
                raise UserError(
                    f"data.eval_subset lists {name} under {wnid}, but data.val_labels "
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
        required = self._robustbench_labels()
        if required is not None:
            classes = {name.split("/")[0] for name in subset}
            wrong = sorted(w for w in classes if dataset.class_to_label.get(w) != required.get(w))
            if wrong:
                raise UserError(
                    f"data.class_map {self.class_map} labels the RobustBench subset's class {wrong[0]} "
                    f"{dataset.class_to_label.get(wrong[0])}, not {required[wrong[0]]} as the standard ImageNet map "
                    f"does ({len(wrong)} classes differ): its labels follow that map; use data.class_map imagenet"
                )
        return Subset(dataset, [index[name] for name in subset])

    def _split_folder_holdout(self, train: LabelledImageFolder, evaluation) -> tuple[Subset, Subset]:
        """A fixed random subset of train (the same in every run and on every rank) becomes the selection split."""
        if self.holdout >= len(train):
            raise UserError(f"data.holdout {self.holdout} must be smaller than the {len(train)} training images")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(HOLDOUT_SEED)).tolist()
        held = copy.copy(train)
        held.transform = evaluation
        return ReplayableSubset(train, sorted(order[self.holdout :])), Subset(held, sorted(order[: self.holdout]))

    def _split_shard_holdout(self, spec: str, urls: list[str]) -> tuple[list[str], list[str], int]:
        """The last training shards (shuffled at conversion) hold the selection split: (train urls, held urls,
        images removed from training). Samples of the held shards beyond ``holdout`` are used by neither."""
        manifest = read_manifest(spec) if _is_dir(spec) else None
        if manifest is None:
            raise UserError(
                "data.holdout with shards needs a shard directory with manifest.json (written by "
                "robust-lightning shards), to know how many images each held-out shard holds"
            )
        counts = [s["num_samples"] for s in manifest["shards"]]
        held = 0
        for n_held, count in enumerate(reversed(counts), start=1):  # noqa: B007 - read after the loop
            held += count
            if held >= self.holdout:
                break
        if held < self.holdout or n_held == len(counts):
            raise UserError(
                f"data.holdout {self.holdout} needs fewer images than the training shards hold "
                f"({sum(counts)} in {len(counts)} shards), with at least one shard left for training"
            )
        return urls[:-n_held], urls[-n_held:], held

    def _split_dir(self, split: str) -> Path:
        path = self.root / split
        if not path.is_dir():
            raise UserError(f"{path} does not exist; expected the ImageFolder layout {self.root}/{split}/<wnid>/*.JPEG")
        return path

    @staticmethod
    def _resolve_shards(spec: str, size: int | None, check_sizes: bool = True) -> tuple[list[str], int | None]:
        """Shard URLs and the number of images they hold (from the manifest if there is one)."""
        if _is_dir(spec):
            manifest = read_manifest(spec)
            return shard_urls(spec, check_sizes), manifest["num_samples"]
        urls = list(braceexpand(spec))
        if not spec.startswith("pipe:"):
            missing = [u for u in urls if not Path(u.removeprefix("file:")).is_file()]
            if missing:
                raise UserError(
                    f"{len(missing)} of {len(urls)} shards of {spec} do not exist (first: {missing[0]}); expected "
                    "a shard directory with manifest.json, a brace pattern of .tar files, or a pipe: URL"
                )
        return urls, size

    def _rank_shards(self, urls: list[str]) -> ShardShare:
        """This rank's part of a split's shards (samples of shared shards when there are more ranks than shards)."""
        return ShardShare.of_rank(urls, self.world_size, self.rank)

    @property
    def global_batch(self) -> int:
        """Training images per optimiser step over all ranks."""
        return self.global_batch_size or self.batch_size * self.world_size

    # ---------------------------------------------------------------------------------------- dataloaders
    def _loader(self, dataset, batch_size: int, **kwargs) -> DataLoader:
        kwargs.setdefault("num_workers", self.num_workers)
        if type(dataset) is ShardStream:  # more workers than shards would sit idle
            kwargs["num_workers"] = min(kwargs["num_workers"], len(dataset.urls))
        elif isinstance(dataset, HoldoutStream):  # each worker reads every held-out shard: keep the I/O small
            kwargs["num_workers"] = min(kwargs["num_workers"], 2)
        loader_cls = kwargs.pop("loader_cls", DataLoader)
        kwargs.setdefault("collate_fn", collate)
        if kwargs["num_workers"] > 0:  # the training process handles SIGTERM / SIGUSR1, not its workers
            kwargs.setdefault("worker_init_fn", ignore_job_signals)
        return loader_cls(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), **kwargs)

    def train_dataloader(self) -> DataLoader:
        augmenting = partial(collate, augment=self.worker_augment) if self.worker_augment else collate
        if isinstance(self.train_set, ShardStream):
            # every rank reads its own shards, so the ranks' batches are distinct images
            batches = self.train_images // self.global_batch
            if batches < 1:
                raise UserError(
                    f"{self.train_images} training images are fewer than one global batch of {self.global_batch}"
                )
            return self._loader(
                self.train_set,
                self.batch_size,
                loader_cls=ShardTrainLoader,
                batches_per_epoch=batches,
                current_epoch=lambda: self.trainer.current_epoch if self.trainer else 0,
                drop_last=True,
                collate_fn=augmenting,
                micro_batches=self.micro_batches,
                rank=self.rank,
                position=self.training_position,
            )
        if len(self.train_set) < self.global_batch:
            raise UserError(
                f"{len(self.train_set)} training images are fewer than one global batch of {self.global_batch}"
            )
        sampler = GlobalBatchSampler(self.train_set, self.world_size, self.rank, self.global_batch, self.seed)
        # workers that only decode draw nothing and may persist; workers that crop or augment are seeded per epoch
        draws_in_workers = self.worker_augment is not None or not self.uses_canvases
        return self._loader(
            self.train_set,
            self.batch_size,
            loader_cls=EpochLoader,
            sampler=sampler,
            drop_last=True,
            persistent_workers=self.num_workers > 0 and not draws_in_workers,
            collate_fn=augmenting,
            generator=torch.Generator().manual_seed(self.seed),  # keeps iterator creation off the global generator
            micro_batches=self.micro_batches,
            rank=self.rank,
            position=self.training_position,
        )

    def _eval_dataloader(self, dataset: Dataset | None = None, batch_size: int | None = None, **kwargs) -> DataLoader:
        dataset = self.eval_set if dataset is None else dataset
        batch_size = batch_size or self.eval_batch_size
        if isinstance(dataset, ShardStream):
            return self._loader(dataset, batch_size, **kwargs)
        if len(dataset) < self.world_size:  # a rank with no batch skips the loop and its hooks: the others hang
            raise UserError(
                f"{len(dataset)} evaluation images cannot be split over {self.world_size} processes; "
                "evaluate more images or on fewer devices"
            )
        sampler = ExactDistributedSampler(dataset, self.world_size, self.rank)
        return self._loader(dataset, batch_size, sampler=sampler, **kwargs)

    def val_dataloader(self) -> DataLoader:
        return self._eval_dataloader()

    test_dataloader = predict_dataloader = val_dataloader

    def eval_dataloader_with(
        self, transform, batch_size: int | None = None, num_workers: int | None = None
    ) -> DataLoader:
        """The evaluation images of the last ``setup`` (same subset, limit and share of this rank) through
        another per-image transform: e.g. another resolution, or corruptions generated on the fly.
        ``transform`` takes a lazily opened PIL image and returns a uint8 tensor; None: the evaluation
        preprocessing at ``image_size`` and ``crop_pct``. ``num_workers``: default data.num_workers."""
        if not hasattr(self, "eval_set"):
            raise RuntimeError("eval_dataloader_with needs setup('test') (or 'validate') first")
        transform = transform or eval_transform(self.image_size, self.crop_pct, self.eval_resize)
        dataset = copy.copy(self.eval_set)
        inner = dataset
        if isinstance(dataset, Subset):  # a folder subset or limit: swap the transform of a copy of the folder
            inner = dataset.dataset = copy.copy(dataset.dataset)
        inner.transform = transform
        workers = {} if num_workers is None else {"num_workers": num_workers}
        return self._eval_dataloader(dataset, batch_size, **workers)

    def expected_eval_images(self) -> tuple[int | None, frozenset[str] | None]:
        """What the last ``setup`` selected for evaluation, where it is known before the images are read: (the
        number of images of a shard selection (manifest, list or limit), the keys of a listed subset); None
        where not known (or, for a folder, where every file is found by listing it)."""
        return self.eval_images, self.eval_keys

    def expected_eval_image_count(self) -> int | None:
        """How many images an evaluation epoch over all ranks must read (decodable or not), None where unknown
        (shards given by a pattern without a manifest)."""
        if isinstance(self.eval_set, IterableDataset):
            return self.eval_images
        return len(self.eval_set)

    def damaged_eval_shards(self) -> list[str]:
        """The evaluation shards that are missing or whose size differs from their manifest entry, then, if there
        are any, how to rewrite them (the command, where the manifest records it)."""
        if not _is_dir(self.eval_shard_spec):
            return []
        manifest = read_manifest(self.eval_shard_spec) or {"shards": []}
        damaged = []
        for shard in manifest["shards"]:
            path = Path(self.eval_shard_spec) / shard["file"]
            if not path.is_file():
                damaged.append(f"{path} (missing)")
            elif "bytes" in shard and path.stat().st_size != shard["bytes"]:
                damaged.append(f"{path} ({path.stat().st_size} of {shard['bytes']} bytes)")
        return damaged + [repair_hint(self.eval_shard_spec)] if damaged else []

    def training_sample(
        self,
        device: torch.device | str,
        fraction: float = 1.0,
        max_images: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> TrainingSample:
        """Training batches exactly as training_step receives them (the training transform and crop, the
        augmentation scheme, MixUp/CutMix soft targets), ``batch_size`` images each (default data.batch_size;
        MixUp/CutMix mix within a batch), for a fixed random subset of the training set: round(fraction x
        training images) of them drawn with ``seed``, the first ``max_images`` of those when given.

        Works outside the fit loop (an analysis after test): without setup('fit') the training set is set up on
        a copy of this data module, so the evaluation set of the running test stays as it is. A folder's subset
        is a seeded permutation's first images; a shard stream reads its shards in a seeded order (they are
        shuffled when written) through the shuffle buffer and keeps the first images. Augmentation draws from
        streams keyed by (data.seed, ``seed``, batch index, rank): the same batches in every call with the same
        arguments, and never the streams of a training epoch."""
        if not 0 < fraction <= 1:
            raise UserError(f"the fraction of the training set must be in (0, 1], got {fraction}")
        if max_images is not None and max_images < 1:
            raise UserError(f"max_images must be a positive number of images, got {max_images}")
        data = self
        if self.train_set is None:
            data = copy.copy(self)
            data.setup("fit")
        generator = torch.Generator().manual_seed(seed)
        if isinstance(data.train_set, ShardStream):
            total = data.train_images
            dataset = copy.copy(data.train_set)
            dataset.repeat, dataset.seed = False, seed  # one pass: every image at most once
            dataset.urls = [dataset.urls[i] for i in torch.randperm(len(dataset.urls), generator=generator)]
        else:
            total = len(data.train_set)
        subset_images = max(1, round(fraction * total))
        images = min(subset_images, max_images or subset_images)
        if not isinstance(data.train_set, ShardStream):
            dataset = Subset(data.train_set, torch.randperm(total, generator=generator)[:images].tolist())
        augmenting = partial(collate, augment=data.worker_augment) if data.worker_augment else collate
        loader = data._loader(dataset, batch_size or data.batch_size, collate_fn=augmenting)
        transform = {
            "augmentation": data.augmentation,
            "augment_on": data.augment_on,
            "crop_scale": list(data.crop_scale),
            "image_size": data.image_size,
            "mixup_cutmix": data.augmentation == "heavy",
        }
        return TrainingSample(
            data._augmented_batches(loader, images, device, seed), images, subset_images, total, transform
        )

    def _augmented_batches(
        self, loader: Iterable[dict], images: int, device: torch.device | str, seed: int
    ) -> Iterator[dict]:
        """The first ``images`` images of ``loader``, moved to ``device`` and augmented as in training."""
        seen = 0
        for index, batch in enumerate(loader):
            if not batch["label"].numel():
                continue
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            batch = self._on_device({**batch, "draw": (-1 - seed, index)}, augment=True)  # no training epoch
            take = min(len(batch["label"]), images - seen)  # cut after mixing: the partners were in the batch
            seen += take
            yield {k: v if k in ("corrupt", "draw") else v[:take] for k, v in batch.items()}
            if seen >= images:
                return

    def state_dict(self) -> dict:
        """Checkpoint state: where training stands in its epoch (resuming mid-epoch, robust_lightning.data.loaders)."""
        return {"training_position": self.training_position.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "training_position" in state:  # checkpoints of earlier versions resume at their epoch's start
            self.training_position.load_state_dict(state["training_position"])

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        training = self.trainer is not None and self.trainer.training
        if training and "draw" in batch:  # about to be trained: the loaders' checkpoint position moves on
            self.training_position.record(batch["draw"])
        return self._on_device(batch, augment=training)

    def batch_streams(self, draw: tuple[int, int] | None, device: torch.device) -> tuple[torch.Generator | None, Any]:
        """The random streams of one training batch's augmentation on ``device``: a torch generator for the
        per-image draws (crop box, flip, RandAugment ops and magnitudes, erasing boxes and noise) and a NumPy
        RandomState for the batch's MixUp/CutMix draws (weight, switch, box), both functions of (data.seed, epoch,
        batch index, rank) alone (``draw`` = (epoch, index), set by the training loaders). Without a draw key:
        the global generators."""
        if draw is None:
            return None, None
        epoch, index = draw
        generator = self._draw_generators.get(device)
        if generator is None:  # one per device, reseeded per batch (seeding reads nothing back from the device)
            generator = self._draw_generators[device] = torch.Generator(device=device)
        generator.manual_seed(draw_seed(self.seed, epoch, index, self.rank, 0))
        return generator, np.random.RandomState(np.random.MT19937(draw_seed(self.seed, epoch, index, self.rank, 1)))

    def _on_device(self, batch: dict, augment: bool) -> dict:
        """uint8 crossed to the device: crop training canvases, augment (``augment``: training batches) and
        scale to [0, 1] there."""
        generator, mix_rng = self.batch_streams(batch.get("draw"), batch["image"].device)
        if "geometry" in batch:  # training canvases: the crop comes first
            batch["image"] = random_resized_crop(
                batch["image"], batch["geometry"], self.image_size, self.crop_scale, generator=generator
            )
        if augment and self.device_augment is not None and batch["label"].numel():
            images, targets = self.device_augment(batch["image"], batch["label"], generator=generator, mix_rng=mix_rng)
            if targets.ndim == 2:  # MixUp/CutMix soft targets; "label" stays the unmixed class
                batch["target"] = targets
            batch["image"] = images
        else:
            batch["image"] = batch["image"].float().div_(255)
        return batch

    # ------------------------------------------------------------------------------------------ reporting
    def differences_from_official_code(self) -> list[str]:
        """How the training data pipeline departs from Singh et al.'s (robust_lightning.official_differences)."""
        return data_differences(self)

    def evaluation_source(self) -> EvaluationSource:
        """Where the evaluation images come from (see ``EvaluationSource``); known from the settings alone."""
        location = {"folder": self.root, "shards": self.val_shards, "synthetic": self.synthetic_root}[self.source]
        return EvaluationSource(
            kind=self.source,
            location=None if location is None else str(location),
            imagenet_val=self.source in ("folder", "shards") and self.class_map == "imagenet" and not self.holdout,
            subset=self.eval_subset,
            limit=self.eval_limit,
        )

    def conditions(self) -> dict[str, Any]:
        """What results.json records about the data."""
        where = {
            "folder": {
                "root": str(self.root),
                "class_map": self.class_map,
                **({"val_labels": self.val_labels} if self.val_labels else {}),
            },
            "shards": {"train_shards": self.train_shards, "val_shards": self.val_shards},
            "synthetic": {**asdict(self.synthetic), "root": str(self.synthetic_root)},
        }[self.source]
        eval_images = self.eval_images if isinstance(self.eval_set, IterableDataset) else len(self.eval_set)
        return {
            "source": self.source,
            **where,
            "num_classes": self.num_classes,
            "eval_images": eval_images,
            "image_size": self.image_size,
            "eval_preprocessing": describe_eval_preprocessing(self.image_size, self.crop_pct, self.eval_resize),
            "augmentation": self.augmentation,
            "augment_on": self.augment_on,
            "augmentation_fill": self.augmentation_fill,
            "full_resolution_decode": not self.uses_canvases,
            **({"canvas_size": self.canvas_size} if self.uses_canvases else {}),
            "differences_from_official_code": self.differences_from_official_code(),
            "eval_split": f"{self.holdout} images held out of train" if self.holdout else "val",
            "eval_subset": self.eval_subset,
            "eval_limit": self.eval_limit,
            "batch_size": self.batch_size,
            "global_batch_size": self.global_batch,
            "max_device_batch_size": self.max_device_batch_size,
            "micro_batches": self.micro_batches,
        }


def _is_dir(spec: str | None) -> bool:
    return spec is not None and not spec.startswith("pipe:") and Path(spec).is_dir()
