"""Reports images that could not be decoded (skipped, counted per epoch across ranks, named in a warning) and
evaluation epochs that read fewer images than the evaluation set holds (a truncated or missing shard)."""

import logging
from collections import defaultdict
from typing import Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT

from robust_lightning.errors import UserError
from robust_lightning.trainer_attributes import datamodule_of

log = logging.getLogger(__name__)


@runtime_checkable
class CountsEvaluationImages(Protocol):
    """A data module that knows how many images an evaluation epoch reads (ImageNetDataModule)."""

    def expected_eval_image_count(self) -> int | None: ...


@runtime_checkable
class NamesDamagedShards(Protocol):
    """A data module that names the evaluation shards it found damaged (ImageNetDataModule)."""

    def damaged_eval_shards(self) -> list[str]: ...


class CorruptImageReport(Callback):
    """Counts the ``corrupt`` entries of each batch (see data.datamodule.collate) and reports them at the end
    of every epoch as ``<stage>/corrupt_images`` (summed over ranks) plus a warning naming the files."""

    def __init__(self) -> None:
        self.epoch_names: dict[str, list[str]] = defaultdict(list)
        self.totals: dict[str, int] = defaultdict(int)  # over the whole run, for results.json
        self.epoch_read: dict[str, int] = defaultdict(int)  # images of this epoch, decodable or not
        self.image_counts: dict[str, dict[str, int]] = {}  # last evaluation epoch per stage, for results.json

    def _collect(self, stage: str, batch: object) -> None:
        if isinstance(batch, dict):
            self.epoch_read[stage] += len(batch.get("key", ())) + len(batch.get("corrupt", ()))
        if isinstance(batch, dict) and batch.get("corrupt"):
            self.epoch_names[stage].extend(batch["corrupt"])

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        names = self.epoch_names.pop(stage, [])
        count = trainer.strategy.reduce(torch.tensor(float(len(names)), device=pl_module.device), reduce_op="sum")
        self.totals[stage] += int(count.item())
        if stage != "predict":  # Lightning allows no logging in predict
            pl_module.log(f"{stage}/corrupt_images", count)  # already a sum over ranks: no sync_dist
        if names:  # every rank names its own files
            shown = "\n  ".join(names[:20]) + (f"\n  ... and {len(names) - 20} more" if len(names) > 20 else "")
            log.warning(
                f"\n[rank {trainer.global_rank}] skipped {len(names)} corrupt image(s) in this {stage} epoch:"
                f"\n  {shown}"
            )
        read = trainer.strategy.reduce(
            torch.tensor(float(self.epoch_read.pop(stage, 0)), device=pl_module.device), reduce_op="sum"
        )
        if stage in ("val", "test"):
            self._check_complete(trainer, pl_module, stage, int(read.item()), int(count.item()))

    def _check_complete(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str, read: int, corrupt: int
    ) -> None:
        """Compare the images read over all ranks with the evaluation set's size; data.on_missing_images decides
        whether a shortfall stops the run or is reported."""
        data = datamodule_of(trainer)
        expected = data.expected_eval_image_count() if isinstance(data, CountsEvaluationImages) else None
        limit = trainer.limit_val_batches if stage == "val" else trainer.limit_test_batches
        if expected is None or not (isinstance(limit, float) and limit == 1.0):  # unknown, or cut on purpose
            return
        missing = max(0, expected - read)
        self.image_counts[stage] = {"expected": expected, "read": read, "corrupt": corrupt, "missing": missing}
        pl_module.log(f"{stage}/expected_images", float(expected))  # equal on every rank: no sync_dist
        pl_module.log(f"{stage}/missing_images", float(missing))
        if not missing:
            return
        damaged = data.damaged_eval_shards() if isinstance(data, NamesDamagedShards) else []
        message = (
            f"{stage}: read {read} of the {expected} evaluation images ({missing} missing, {corrupt} of those "
            f"read undecodable)" + (f"; damaged shards: {', '.join(damaged)}" if damaged else "")
        )
        if getattr(data, "on_missing_images", "error") == "error":
            raise UserError(
                f"{message}; re-create the data, or set data.on_missing_images warn to evaluate what is there"
            )
        rank_zero_warn(f"\n{message}; the metrics are of the images read (data.on_missing_images warn)")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: object, batch_idx: int
    ) -> None:
        self._collect("train", batch)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self._collect("val", batch)

    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._collect("test", batch)

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._collect("predict", batch)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module, "train")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module, "test")

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module, "predict")
