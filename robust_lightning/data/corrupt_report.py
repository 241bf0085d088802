"""Reports images that could not be decoded: skipped, counted per epoch across ranks, named in a warning."""

import logging
from collections import defaultdict

import torch
from lightning import Callback

log = logging.getLogger(__name__)


class CorruptImageReport(Callback):
    """Counts the ``corrupt`` entries of each batch (see data.datamodule.collate) and reports them at the end
    of every epoch as ``<stage>/corrupt_images`` (summed over ranks) plus a warning naming the files."""

    def __init__(self):
        self.epoch_names: dict[str, list[str]] = defaultdict(list)
        self.totals: dict[str, int] = defaultdict(int)  # over the whole run, for results.json

    def _collect(self, stage: str, batch) -> None:
        if isinstance(batch, dict) and batch.get("corrupt"):
            self.epoch_names[stage].extend(batch["corrupt"])

    def _report(self, trainer, pl_module, stage: str) -> None:
        names = self.epoch_names.pop(stage, [])
        count = trainer.strategy.reduce(torch.tensor(float(len(names)), device=pl_module.device), reduce_op="sum")
        self.totals[stage] += int(count.item())
        if stage != "predict":  # Lightning allows no logging in predict
            pl_module.log(f"{stage}/corrupt_images", count, sync_dist=True)  # already a sum over ranks
        if names:  # every rank names its own files
            shown = "\n  ".join(names[:20]) + (f"\n  ... and {len(names) - 20} more" if len(names) > 20 else "")
            log.warning(f"[rank {trainer.global_rank}] skipped {len(names)} corrupt image(s) in this {stage} epoch:\n  {shown}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._collect("train", batch)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._collect("val", batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._collect("test", batch)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._collect("predict", batch)

    def on_train_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "train")

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "test")

    def on_predict_epoch_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "predict")
