"""Checkpoints that a kill -9 can never leave half-written, and a last.ckpt that is always the latest.

Lightning's own "atomic" save writes through an fsspec transaction, which stages the file in the system
temp directory and moves it into place: across filesystems (local /tmp, checkpoints on a shared cluster
filesystem) that move is a copy, and a job killed during it leaves a truncated last.ckpt. Here the bytes go
through ``robust_lightning.atomic`` (a temporary file beside the target, fsynced, one rename). Remote URLs
(s3://, ...) keep Lightning's behaviour.

Lightning 2.6 writes last.ckpt only when it also saves a top-k checkpoint at the same step: whenever the monitored
score does not improve, last.ckpt stays at the best epoch, and ``fit --ckpt_path last`` would silently train the
later epochs again. ``LatestCheckpoint`` writes it at every save point.
"""

import io
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from robust_lightning.atomic import atomic_write_bytes


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options}")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())


class LatestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, with last.ckpt (``save_last``) written at every save point, whether or not a
    top-k checkpoint was saved there."""

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's own key: the best score and paths of checkpoints written by it still restore
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def _save_last_if_behind(self, trainer) -> None:
        # skipped when a checkpoint (and with it last.ckpt) was saved at this step, in sanity checks and outside fit
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
