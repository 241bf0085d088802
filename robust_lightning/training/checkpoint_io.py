"""Checkpoints that a kill -9 can never leave half-written, and a last.ckpt that is always the latest.

Lightning's own "atomic" save writes through an fsspec transaction, which stages the file in the system
temp directory and moves it into place: across filesystems (local /tmp, checkpoints on a shared cluster
filesystem) that move is a copy, and a job killed during it leaves a truncated last.ckpt. Here the bytes go
through ``robust_lightning.atomic`` (a temporary file beside the target, fsynced, one rename). Remote URLs
(s3://, ...) keep Lightning's behaviour.

Lightning 2.6 writes last.ckpt only when it also saves a top-k checkpoint at the same step: whenever the monitored
score does not improve, last.ckpt stays at the best epoch, and ``fit --ckpt_path last`` would silently train the
later epochs again. ``LatestCheckpoint`` writes it at every save point.

``checkpoint.every_n_train_steps`` bounds the work a kill loses: every n training steps ``LatestCheckpoint``
writes last.ckpt, the checkpoint a resume starts from, from the first epoch on. The best checkpoints are still
chosen at the ends of the validations, with the scores of the weights they save, and so are the epoch-end saves.
Lightning's own step saves would keep top-k files scored with the last validation's score (the weights of later
steps, saved under an older score), write nothing until a validation has logged the monitored score (a first epoch
of hours without a checkpoint), and turn the epoch-end saves off. A run that keeps every checkpoint
(``save_top_k: -1`` without a monitor) keeps a file every n steps as well. No step checkpoint is written where the
epoch's end or a validation follows the step: resumed from there, Lightning would skip them; the save at their end
comes soon after.

Lightning warns that a checkpoint directory "exists and is not empty" whatever is in it: every fresh fit into a
fixed ``checkpoint.dirpath`` would, for the lock and owner marker its own FitRunDirectory has just written there, and
so would every resume, for the run's own checkpoints. ``LatestCheckpoint`` keeps the warning for checkpoints that
are not the run's own (a fit into a folder another attempt of its run directory saved in), and says so when a fit
resumed from its run's checkpoints goes on writing them.
"""

import io
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT

from robust_lightning.atomic import atomic_write_bytes
from robust_lightning.paths import run_directory


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options}")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())


def validation_or_epoch_end_follows(trainer: pl.Trainer) -> bool:
    """Whether the training step that just ended is followed by a validation or by its epoch's end, where
    Lightning's resume from a checkpoint of this point would skip them (it counts a step checkpointed at its end as
    done, epoch-end work included)."""
    loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    assert fetcher is not None  # the fit loop's for the epoch a training step is in (the loop asserts the same)
    return bool(loop._num_ready_batches_reached() or loop._should_check_val_fx(fetcher))


class LatestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, with last.ckpt (``save_last``) written at every save point, whether or not a
    top-k checkpoint was saved there, ``every_n_train_steps`` as the steps between checkpoints to resume from, and
    its warning of a non-empty folder given only where it is true (module docstring)."""

    _unjudged: Path | None = None  # a folder holding checkpoints at the setup of a fit: whose they are is known later
    _resume_every: int = 0  # every_n_train_steps as configured: the steps between two last.ckpt
    _configured: tuple[int, int] | None = None  # every_n_train_steps and every_n_epochs as configured (state_key)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self._configured is None:
            self._configured = (self._every_n_train_steps, self._every_n_epochs)
            if self._every_n_train_steps:  # Lightning allows no every_n_epochs beside it: it is 0
                self._resume_every, self._every_n_train_steps = self._every_n_train_steps, 0
                if self._train_time_interval is None:
                    self._every_n_epochs = 1

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        every = self._resume_every
        if (
            not every
            or trainer.global_step % every
            or self._should_skip_saving_checkpoint(trainer)
            or trainer.fit_loop.epoch_loop._should_accumulate()  # a step still accumulating its gradient
            or validation_or_epoch_end_follows(trainer)
        ):
            return
        candidates = self._monitor_candidates(trainer)
        if self.save_top_k == -1 and self.monitor is None:  # every checkpoint is kept: this one too
            self._save_topk_checkpoint(trainer, candidates)
        save_last, self.save_last = self.save_last, True  # the point of a step checkpoint is the resume
        try:
            self._save_last_checkpoint(trainer, candidates)
        finally:
            self.save_last = save_last

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath: _PATH) -> None:
        """Lightning's check of the folder at the setup of a fit (global rank zero). Only checkpoints count, the
        files a save can replace; whether they are this run's is known once the fit has restored its checkpoint,
        so they are judged at the start of training (``on_train_start``)."""
        if "://" in str(dirpath):  # remote: Lightning's own check
            # Lightning's private check, by its mangled name (mypy does not mangle it)
            super()._ModelCheckpoint__warn_if_dir_not_empty(dirpath)  # type: ignore[misc]
            return
        folder = Path(dirpath)
        if self.save_top_k != 0 and folder.is_dir() and any(not p.name.startswith(".") for p in folder.glob("*.ckpt")):
            self._unjudged = folder

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
        # ModelCheckpoint's own key, with the options as configured: the best score and paths of checkpoints
        # written by it, and by earlier versions, still restore
        every_n_train_steps, every_n_epochs = self._configured or (self._every_n_train_steps, self._every_n_epochs)
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            train_time_interval=self._train_time_interval,
        ).replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def _save_last_if_behind(self, trainer: pl.Trainer) -> None:
        # skipped when a checkpoint (and with it last.ckpt) was saved at this step, in sanity checks and outside fit
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
