"""Checkpoints that a kill -9 can never leave half-written, and a last.ckpt that is always the latest.

Lightning's own "atomic" save writes through an fsspec transaction, which stages the file in the system
temp directory and moves it into place: across filesystems (local /tmp, checkpoints on a shared cluster
filesystem) that move is a copy, and a job killed during it leaves a truncated last.ckpt. Here the bytes go
through ``robust_lightning.atomic`` (a temporary file beside the target, fsynced, one rename). Remote URLs
(s3://, ...) keep Lightning's behaviour.

Lightning 2.6 writes last.ckpt only when it also saves a top-k checkpoint at the same step: whenever the monitored
score does not improve, last.ckpt stays at the best epoch, and ``fit --ckpt_path last`` would silently train the
later epochs again. ``LatestCheckpoint`` writes it at every save point.

Lightning warns that a checkpoint directory "exists and is not empty" whatever is in it: every fresh fit into a
fixed ``checkpoint.dirpath`` would, for the lock and owner marker its own FitRunDirectory has just written there, and
so would every resume, for the run's own checkpoints. ``LatestCheckpoint`` keeps the warning for checkpoints that
are not the run's own (a fit into a folder another attempt of its run directory saved in), and says so when a fit
resumed from its run's checkpoints goes on writing them.
"""

import io
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from robust_lightning.atomic import atomic_write_bytes
from robust_lightning.paths import run_directory


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
    top-k checkpoint was saved there, and its warning of a non-empty folder given only where it is true (module
    docstring)."""

    _unjudged: Path | None = None  # a folder holding checkpoints at the setup of a fit: whose they are is known later

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath) -> None:
        """Lightning's check of the folder at the setup of a fit (global rank zero). Only checkpoints count, the
        files a save can replace; whether they are this run's is known once the fit has restored its checkpoint,
        so they are judged at the start of training (``on_train_start``)."""
        if "://" in str(dirpath):  # remote: Lightning's own check
            # Lightning's private check, by its mangled name (mypy does not mangle it)
            return super()._ModelCheckpoint__warn_if_dir_not_empty(dirpath)  # type: ignore[misc]
        folder = Path(dirpath)
        if self.save_top_k != 0 and folder.is_dir() and any(not p.name.startswith(".") for p in folder.glob("*.ckpt")):
            self._unjudged = folder

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        folder, self._unjudged = self._unjudged, None
        if folder is None or not trainer.is_global_zero:
            return
        resumed = trainer.ckpt_path
        resumed = Path(resumed).resolve() if resumed and "://" not in str(resumed) else None
        if resumed is not None and any(resumed.is_relative_to(d.resolve()) for d in (folder, run_directory(trainer))):
            rank_zero_info(f"checkpoint directory {folder}: this run's checkpoints, which the resumed fit goes on with")
        else:  # another run's, or an earlier attempt's that this fit starts over from scratch
            super()._ModelCheckpoint__warn_if_dir_not_empty(folder)  # type: ignore[misc]  # as above

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
