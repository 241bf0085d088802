"""ImageNet-style data for training and evaluation, from any source (robust_lightning.data.sources).

Distribution across ranks is decided here, not by Lightning, whose default is wrong twice over: its validation
DistributedSampler pads ranks with repeated samples (double counting), and webdataset 1.0.2's split_by_node reads
the rank from the environment, so it does not split under spawn-started workers. The rank and world size are
captured in setup() and every rank reads a disjoint part of the data.
"""

import copy
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, IterableDataset

from robust_lightning.data.batching import GlobalBatch
from robust_lightning.data.classes import class_map as load_class_map
from robust_lightning.data.contract import EvaluationSource, TrainingSample
from robust_lightning.data.datasets import with_transform
from robust_lightning.data.loaders import EpochLoader, StreamTrainLoader, TrainingPosition, data_loader
from robust_lightning.data.samplers import ExactDistributedSampler, GlobalBatchSampler
from robust_lightning.data.sources import (
    DataSets,
    DataSource,
    SetRequest,
    SyntheticSource,
    check_built,
    damaged_shards,
    read_eval_subset,
    training_subset,
)
from robust_lightning.data.training_augmentation import TrainingAugmentation
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


class ImageNetDataModule(LightningDataModule):
    """ImageNet-style classification data for training and evaluation. Evaluations use it only through
    ``EvaluationData``: ``image_size``, ``crop_pct``, ``num_workers`` and the methods listed there.

    Args:
        source: where the images come from (robust_lightning.data.sources): ``SyntheticSource`` (built in, no
            download), ``FolderSource`` (ImageFolder roots) or ``ShardSource`` (WebDataset shards), each with
            its own options; chosen in the config by class_path.
        num_classes: size of the label space; defaults to the source's (the class map's, 1000 for ImageNet).
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
            PIL in the loader workers, as the official pipeline does, instead of decoding canvases (canvas_size);
            the augmentation after the crop still runs where augment_on says ("cpu" always decodes in full).
        crop_scale: area range of RandomResizedCrop.
        canvas_size: with augment_on "device", workers decode each training image into a canvas of this side
            (default 16/7 of image_size: 512 for 224); larger images are decoded at reduced scale to fit (JPEG DCT
            scaling by 2, 4 or 8; benchmarks/decode_scale.py), and crop boxes are drawn on the original size.
        eval_subset: evaluate (test/predict, and validate without holdout) only the images listed in a file of
            ``class_folder/file_name`` lines, in its order: "robustbench" is the RobustBench 5000-image ImageNet
            subset (data/robustbench_imagenet_test_image_ids.txt), anything else a path. Folder trees are read
            in the file's order; shards are filtered by sample key (the file name's stem) in stream order, and
            each image must be of the class the file lists. The RobustBench subset's labels must be ImageNet's
            (FolderSource class_map imagenet, shards written with it): anything else is an error.
        eval_limit: evaluate only the first n images (of the subset, if one is set).
        holdout: training images held out for checkpoint selection (the paper holds out 4000 ImageNet train
            images, disjoint from the evaluation images). When > 0, validation runs on them instead of the
            val split and training never sees them; test and predict still use the val split.
        label_smoothing: smoothing of the MixUp/CutMix soft targets (linked from model.label_smoothing).
        batch_size: per-device training batch size.
        global_batch_size: the effective batch over all devices and nodes (the paper's recipes fix it), split
            over the devices as evenly as possible; the loss is weighted so that the update is that of the mean
            loss over the whole global batch (robust_lightning.data.batching.GlobalBatch).
        max_device_batch_size: images per forward pass on one device during training: a larger share of the
            global batch is split into micro-batches whose gradients are accumulated, so that every optimiser
            step still sees exactly the global batch (GlobalBatch). None: one forward per step. Either option
            refuses trainer.accumulate_grad_batches, which would multiply the global batch.
        eval_batch_size: per-device evaluation batch size (default: batch_size).
        num_workers: decoding processes per device.
        shuffle_buffer: samples held for shuffling within the training shard stream.
        seed: data order and augmentation seed (shard order, shuffle buffer, sampler; every training batch's
            augmentation draws from streams keyed by (seed, epoch, batch index, rank), so ranks draw differently
            and a run resumed at an epoch boundary draws what the uninterrupted one drew).
        on_missing_images: what an evaluation epoch that read fewer images than the evaluation set holds (a
            truncated or missing shard, a listed image absent from the shards) does: "error" (stop, naming the
            counts and the damaged shards) or "warn" (the counts go to results.json and the logged metrics as
            <stage>/expected_images and <stage>/missing_images). Undecodable images count as <stage>/corrupt_images.
    """

    def __init__(
        self,
        source: DataSource = SyntheticSource(),  # noqa: B008 - a default --print_config shows; never mutated
        num_classes: int | None = None,
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
    ):
        super().__init__()
        # Plain attributes, not save_hyperparameters(): checkpoints must load with weights_only=True, which
        # refuses the source object; the full config is saved beside the run as config.yaml anyway.
        self.source = source
        self.image_size, self.crop_pct = image_size, crop_pct
        if eval_resize not in EVAL_RESIZES:
            raise UserError(f"data.eval_resize must be one of {', '.join(EVAL_RESIZES)}, got {eval_resize!r}")
        self.eval_resize = eval_resize
        self.augmentation, self.augment_on = augmentation, augment_on
        self.crop_scale: tuple[float, float] = (crop_scale[0], crop_scale[1])
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
        self.global_batch = GlobalBatch(global_batch_size, batch_size, max_device_batch_size)
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers, self.shuffle_buffer, self.seed = num_workers, shuffle_buffer, seed
        if on_missing_images not in ("error", "warn"):
            raise UserError(f"data.on_missing_images must be 'error' or 'warn', got {on_missing_images!r}")
        self.on_missing_images = on_missing_images
        self.rank, self.world_size = 0, 1
        self.training_position = TrainingPosition()  # checkpoint state of the training loaders (resuming mid-epoch)
        self.sets = DataSets()  # what the source built in the last setup
        self.num_classes = source.num_classes(num_classes)
        self.training_augmentation = TrainingAugmentation(
            augmentation,
            self.num_classes,
            on=augment_on,
            fill=augmentation_fill,
            label_smoothing=label_smoothing,
            image_size=image_size,
            crop_scale=self.crop_scale,
            seed=seed,
        )

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        self.global_batch.place(self.world_size, self.rank)
        if stage == "fit" and self.trainer is not None:
            self.global_batch.accumulate_in(self.trainer)
        evaluation = eval_transform(self.image_size, self.crop_pct, self.eval_resize)
        uses_canvases = self.uses_canvases
        training = (
            CanvasDecode(self.canvas_size) if uses_canvases else train_transform(self.image_size, self.crop_scale)
        )
        self.training_augmentation.rank = self.rank  # each rank draws its own augmentation
        # validation of fit and validate runs on the held-out part of train when there is one
        on_holdout = self.holdout > 0 and stage in ("fit", "validate")
        request = SetRequest(
            training,
            evaluation,
            needs_train=stage == "fit" or on_holdout,
            on_holdout=on_holdout,
            holdout=self.holdout,
            subset=None if on_holdout else read_eval_subset(self.eval_subset, self.eval_limit),
            # the RobustBench subset's models and numbers use ImageNet's labels
            subset_labels=load_class_map("imagenet") if self.eval_subset == "robustbench" else None,
            limit=self.eval_limit,
            read_damaged=self.on_missing_images == "warn",
            shuffle_buffer=self.shuffle_buffer,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
        )
        sets = self.source.build(request)
        # a source that left out the holdout, subset or limit would be evaluated whole under their names
        check_built(self.source, request, sets)
        self.sets = sets

    @property
    def train_set(self) -> Dataset | None:
        return self.sets.train

    @property
    def eval_set(self) -> Dataset | None:
        return self.sets.evaluation

    @property
    def uses_canvases(self) -> bool:
        """Training images decoded into canvases (reduced scale when large) and cropped on the device."""
        return self.augment_on == "device" and not self.full_resolution_decode

    def train_dataloader(self) -> DataLoader:
        train, images = self.sets.training()
        if images < self.global_batch.images:
            raise UserError(f"{images} training images are fewer than one global batch of {self.global_batch.images}")
        batch = self.global_batch
        options: dict[str, Any] = dict(
            num_workers=self.num_workers,
            drop_last=True,
            collate_fn=self.training_augmentation.collate,
            micro_batches=batch.micro_batches,
            rank=self.rank,
            position=self.training_position,
        )
        if isinstance(train, IterableDataset):  # a stream reads this rank's share itself: distinct images
            return data_loader(
                train,
                batch.share,
                StreamTrainLoader,
                batches_per_epoch=images // batch.images,
                current_epoch=lambda: self.trainer.current_epoch if self.trainer else 0,
                seed=self.seed,
                **options,
            )
        # workers that only decode draw nothing and may persist; workers that crop or augment are seeded per epoch
        draws_in_workers = self.training_augmentation.worker is not None or not self.uses_canvases
        return data_loader(
            train,
            batch.share,
            EpochLoader,
            sampler=GlobalBatchSampler(train, self.world_size, self.rank, batch.images, self.seed),
            persistent_workers=self.num_workers > 0 and not draws_in_workers,
            generator=torch.Generator().manual_seed(self.seed),  # keeps iterator creation off the global generator
            **options,
        )

    def _eval_dataloader(
        self, dataset: Dataset | None = None, batch_size: int | None = None, num_workers: int | None = None
    ) -> DataLoader:
        dataset = self.eval_set if dataset is None else dataset
        assert dataset is not None  # set up by setup()
        workers = self.num_workers if num_workers is None else num_workers
        if isinstance(dataset, IterableDataset):  # a stream reads this rank's share itself
            return data_loader(dataset, batch_size or self.eval_batch_size, num_workers=workers)
        images = len(dataset)  # type: ignore[arg-type]  # a map-style set has a length
        if images < self.world_size:  # a rank with no batch skips the loop and its hooks: the others hang
            raise UserError(
                f"{images} evaluation images cannot be split over {self.world_size} processes; "
                "evaluate more images or on fewer devices"
            )
        sampler = ExactDistributedSampler(dataset, self.world_size, self.rank)
        return data_loader(dataset, batch_size or self.eval_batch_size, num_workers=workers, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return self._eval_dataloader()

    test_dataloader = predict_dataloader = val_dataloader

    def eval_dataloader_with(
        self, transform: Callable[[Any], Any] | None, batch_size: int | None = None, num_workers: int | None = None
    ) -> DataLoader:
        """The evaluation images of the last ``setup`` (same subset, limit and share of this rank) through
        another per-image transform: e.g. another resolution, or corruptions generated on the fly.
        ``transform`` takes a lazily opened PIL image and returns a uint8 tensor; None: the evaluation
        preprocessing at ``image_size`` and ``crop_pct``. ``num_workers``: default data.num_workers."""
        if self.eval_set is None:
            raise RuntimeError("eval_dataloader_with needs setup('test') (or 'validate') first")
        transform = transform or eval_transform(self.image_size, self.crop_pct, self.eval_resize)
        return self._eval_dataloader(with_transform(self.eval_set, transform), batch_size, num_workers)

    def expected_eval_images(self) -> tuple[int | None, frozenset[str] | None]:
        """What the last ``setup`` selected for evaluation, where it is known before the images are read: (the
        number of images of a shard selection (manifest, list or limit), the keys of a listed subset); None
        where not known (or, for a folder, where every file is found by listing it)."""
        return self.sets.eval_images, self.sets.eval_keys

    def expected_eval_image_count(self) -> int | None:
        """How many images an evaluation epoch over all ranks must read (decodable or not), None where unknown
        (shards given by a pattern without a manifest)."""
        return self.sets.evaluation_images()

    def damaged_eval_shards(self) -> list[str]:
        """The evaluation shards that are missing or damaged, then how to rewrite them (``damaged_shards``)."""
        return damaged_shards(self.sets.eval_shard_spec)

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
        training images) of them drawn with ``seed`` (``training_subset``), the first ``max_images`` of those.

        Works outside the fit loop (an analysis after test): without setup('fit') the training set is set up on
        a copy of this data module, so the evaluation set of the running test stays as it is. Augmentation draws
        from streams keyed by (data.seed, ``seed``, batch index, rank): the same batches in every call with the
        same arguments, and never the streams of a training epoch."""
        if not 0 < fraction <= 1:
            raise UserError(f"the fraction of the training set must be in (0, 1], got {fraction}")
        if max_images is not None and max_images < 1:
            raise UserError(f"max_images must be a positive number of images, got {max_images}")
        data = self
        if self.train_set is None:
            data = copy.copy(self)
            data.setup("fit")
        dataset, images, subset_images, total = training_subset(data.sets, fraction, max_images, seed)
        collate_fn = data.training_augmentation.collate
        loader = data_loader(
            dataset, batch_size or data.global_batch.share, num_workers=data.num_workers, collate_fn=collate_fn
        )
        transform = {
            "augmentation": data.augmentation,
            "augment_on": data.augment_on,
            "crop_scale": list(data.crop_scale),
            "image_size": data.image_size,
            "mixup_cutmix": data.augmentation == "heavy",
            "augmentation_seed": data.seed,  # with the sample's seed, the key of its augmentation draws
        }
        return TrainingSample(
            data.training_augmentation.batches(loader, images, device, seed), images, subset_images, total, transform
        )

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
        return self.training_augmentation.on_device(batch, augment=training)

    def differences_from_official_code(self) -> list[str]:
        """How the training data pipeline departs from Singh et al.'s (robust_lightning.official_differences)."""
        return data_differences(self)

    def evaluation_source(self) -> EvaluationSource:
        """Where the evaluation images come from (see ``EvaluationSource``); known from the settings alone."""
        return EvaluationSource(
            kind=self.source.kind,
            location=self.source.location(),
            imagenet_val=self.source.imagenet_labels() and not self.holdout,
            subset=self.eval_subset,
            limit=self.eval_limit,
            val_folder=self.source.val_folder(),
        )

    def conditions(self) -> dict[str, Any]:
        """What results.json records about the data."""
        return {
            "source": self.source.kind,
            **self.source.conditions(),
            "num_classes": self.num_classes,
            "eval_images": self.expected_eval_image_count(),
            "image_size": self.image_size,
            "eval_preprocessing": describe_eval_preprocessing(self.image_size, self.crop_pct, self.eval_resize),
            "augmentation": self.augmentation,
            "augment_on": self.augment_on,
            "augmentation_fill": self.augmentation_fill,
            "full_resolution_decode": not self.uses_canvases,
            **({"canvas_size": self.canvas_size} if self.uses_canvases else {}),
            "differences_from_official_code": self.differences_from_official_code(),
            "eval_split": f"{self.holdout} images held out of train" if self.holdout else "val",
            "imagenet_val": self.evaluation_source().imagenet_val,
            "eval_subset": self.eval_subset,
            "eval_limit": self.eval_limit,
            "batch_size": self.global_batch.share,
            "global_batch_size": self.global_batch.images,
            "max_device_batch_size": self.global_batch.max_device_batch,
            "micro_batches": self.global_batch.micro_batches,
        }
