"""Progress display that never makes the host wait for the accelerator inside a training step.

Showing a logged value reads it back from the device, which waits for every queued kernel. Lightning turns the
values logged with ``prog_bar=True`` into numbers after every batch, and its tqdm bar shows them; so nothing is
logged with ``prog_bar`` here, and these displays read the values they show (``SHOWN``, from the trainer's
callback metrics) only after the optimiser steps that Lightning's loggers read them at anyway (every
``trainer.log_every_n_steps`` steps; with gradient accumulation, a micro-batch that only accumulates is no step).
They also read them at the end of a training epoch, on rank zero only, so every value logged at epoch end is
reduced over the ranks before it is logged (``ImageClassifier.on_train_epoch_end``): a value logged with
``sync_dist=True`` would be all-reduced when first read, on rank zero in the display while the other ranks are
elsewhere.

The command line picks one (``default_progress_bar``): a tqdm bar on a terminal, and lines on logs without one
(SLURM's ``.out`` files, where a bar's carriage returns make one unreadable line).

A fit resumed mid-epoch (``--ckpt_path last`` after a SIGTERM, a step checkpoint, SLURM's hpc checkpoint) gets no
``on_train_epoch_start``: both displays then count the elapsed time from the fit's start (``on_train_start``) and
the rate, so the time left, from the batches trained since, not from the epoch's first batch.
"""

import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.utilities.types import STEP_OUTPUT

from robust_lightning.console import is_terminal
from robust_lightning.trainer_attributes import log_every_n_steps

# what a progress bar's get_metrics returns (Lightning's type)
Metrics = dict[str, int | str | float | dict[str, float]]

SHOWN = ("train/loss", "val/acc1", "val/select_acc")  # the logged values a display shows, where logged


def shown_values(trainer: pl.Trainer) -> dict[str, float]:
    """The logged values of ``SHOWN`` as numbers (reading them waits for the device: call at logging steps)."""
    return {name: float(trainer.callback_metrics[name]) for name in SHOWN if name in trainer.callback_metrics}


def _reading_due(trainer: pl.Trainer, batch_idx: int, total: int | float) -> bool:
    """Whether an evaluation's progress may be shown after this batch: every log_every_n_steps batches and the
    last one."""
    n = batch_idx + 1
    return n % max(1, log_every_n_steps(trainer)) == 0 or n == total


def _training_reading_due(trainer: pl.Trainer, batch_idx: int, total: int | float, steps_before: int) -> bool:
    """Whether the logged values may be read after this training batch (``steps_before``: the trainer's global
    step when it started): after an optimiser step that Lightning logs at, and after the epoch's last batch.

    Counting batches instead would read after micro-batches that only accumulate, where nothing else waits for
    the device."""
    stepped = trainer.global_step != steps_before
    logged = stepped and trainer.global_step % max(1, log_every_n_steps(trainer)) == 0
    return logged or batch_idx + 1 == total


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, with the logged values it shows read every ``trainer.log_every_n_steps`` optimiser
    steps."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._read_now = True
        self._shown: Metrics = {}
        self._resumed = False  # between on_train_start and a first batch with no on_train_epoch_start between
        self._steps_before = 0  # the trainer's global step when the current training batch started

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # a new bar: its clock starts here
        self._resumed = True

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resumed = False
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self._steps_before = trainer.global_step
        if self._resumed:  # a fit resumed mid-epoch: the bar of on_train_start, with the epoch's total and the
            # batches trained before the resume as its start, so that tqdm's rate counts those since the resume
            self._resumed = False
            bar = self.train_progress_bar
            bar.total = convert_inf(self.total_train_batches)
            bar.initial = bar.n = bar.last_print_n = batch_idx
            bar.set_description(f"Epoch {trainer.current_epoch}")

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Metrics:
        if self._read_now:
            self._shown = {**super().get_metrics(trainer, pl_module), **shown_values(trainer)}
        return self._shown

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: object, batch_idx: int
    ) -> None:
        self._read_now = _training_reading_due(trainer, batch_idx, self.total_train_batches, self._steps_before)
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._read_now = True


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ProgressLines(ProgressBar):
    """Printed lines for logs read without a terminal (rank zero). A line every ``trainer.log_every_n_steps``
    optimiser steps (in an evaluation, as many batches) gives the epoch, the batch, elapsed time, an estimate of
    the rest and the logged values; one line ends each training epoch, validation, test and prediction."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._started = 0.0
        # batches of this epoch trained before self._started: 0, or where a fit resumed mid-epoch (None until its
        # first batch)
        self._first: int | None = 0
        self._steps_before = 0  # the trainer's global step when the current training batch started

    def disable(self) -> None:  # Lightning disables every rank but zero
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def _print(self, text: str) -> None:
        if self._enabled:
            print(text, file=sys.stdout, flush=True)

    def _line(
        self,
        stage: str,
        batch_idx: int,
        total: int | float,
        started: float,
        first: int = 0,
        metrics: dict[str, float] | None = None,
    ) -> str:
        """The line after batch ``batch_idx``, timed from ``started``, when batch ``first`` began."""
        n, elapsed = batch_idx + 1, time.monotonic() - started
        known = isinstance(total, int) or (isinstance(total, float) and total != float("inf"))
        of = f"/{int(total)}" if known else ""
        rest = f" (~{_duration(elapsed / (n - first) * (total - n))} left)" if known and total > n else ""
        values = f" | {_format(metrics)}" if metrics else ""
        return f"{stage} batch {n}{of} | {_duration(elapsed)}{rest}{values}"

    # ------------------------------------------------------------------------------------------- training
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a fit resumed mid-epoch gets no on_train_epoch_start: its times count from here, the resume
        self._started, self._first = time.monotonic(), None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started, self._first = time.monotonic(), 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self._steps_before = trainer.global_step
        if self._first is None:  # the first batch since a resume mid-epoch
            self._first = batch_idx
            of = f"/{int(self.total_train_batches)}" if self.total_train_batches != float("inf") else ""
            self._print(f"epoch {trainer.current_epoch} resumed at batch {batch_idx + 1}{of}: times count from here")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: object, batch_idx: int
    ) -> None:
        total = self.total_train_batches
        if _training_reading_due(trainer, batch_idx, total, self._steps_before):
            epoch = f"epoch {trainer.current_epoch}"
            self._print(self._line(epoch, batch_idx, total, self._started, self._first or 0, shown_values(trainer)))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        since = "" if self._first == 0 else " since the resume"
        self._print(
            f"epoch {trainer.current_epoch} done in {_duration(time.monotonic() - self._started)}{since} | "
            f"{_format(shown_values(trainer))}"
        )

    # -------------------------------------------------------------------------------- evaluation, predict
    def _evaluation_start(self) -> None:
        self._evaluation_started = time.monotonic()

    def _evaluation_batch(self, trainer: pl.Trainer, stage: str, batch_idx: int, total: int | float) -> None:
        if _reading_due(trainer, batch_idx, total):
            self._print(self._line(stage, batch_idx, total, self._evaluation_started))

    def _evaluation_end(self, trainer: pl.Trainer, stage: str) -> None:
        # computed on every rank by now (Lightning reduces an evaluation's values before its end hooks)
        metrics = {
            k: float(v)
            for k, v in sorted(trainer.callback_metrics.items())
            if k.split("/")[0] in (stage, f"{stage}_ema")
        }
        took = _duration(time.monotonic() - self._evaluation_started)
        self._print(f"{stage} done in {took}" + (f" | {_format(metrics)}" if metrics else ""))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation_start()

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self._evaluation_batch(trainer, "validation", batch_idx, trainer.num_val_batches[dataloader_idx])

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._evaluation_end(trainer, "val")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation_start()

    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._evaluation_batch(trainer, "test", batch_idx, trainer.num_test_batches[dataloader_idx])

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation_end(trainer, "test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation_start()

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._evaluation_batch(trainer, "predict", batch_idx, trainer.num_predict_batches[dataloader_idx])

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        took = _duration(time.monotonic() - self._evaluation_started)
        self._print(f"predict done in {took}")


def default_progress_bar() -> ProgressBar:
    """A tqdm bar when standard output, where Lightning draws it, is a terminal; printed lines otherwise (batch jobs,
    pipes)."""
    return StepProgressBar() if is_terminal(sys.stdout) else ProgressLines()
