"""Throughput of a training run: is it the loader or the accelerator that sets the pace?

Every ``trainer.log_every_n_steps`` optimiser steps, rank zero logs, over the steps since the last log:

- ``perf/images_per_s``: training images per second on one device (this rank's images);
- ``perf/job_images_per_s``: training images per second of the whole job, all ranks together (the global batch
  of every step: ``data.global_batch_size``, or the per-rank batch times the number of ranks);
- ``perf/step_seconds``: wall time per optimiser step;
- ``perf/data_wait_share``: the share of that time spent between one batch's end and the next batch's start,
  waiting for the loader (and the batch's transfer to the device).

As timm's train.py does, the device is synchronised only at these logging steps, so the times are exact over a
logging interval. Between them nothing is waited for: when the accelerator is the bottleneck, part of its queue's
wait can show up as data wait. An interval never spans the validation at an epoch's end: the steps of an epoch
after its last logging step are left out. results.json's fit section holds the same figures over the whole run
(the first interval, with its start-up costs, left out when there are later ones).
"""

import time

import lightning.pytorch as pl
import torch
from lightning import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT

from robust_lightning.data.batching import global_batch_of
from robust_lightning.trainer_attributes import log_every_n_steps


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Throughput(Callback):
    """Logs images/s per device, step time and data-wait share every ``trainer.log_every_n_steps`` optimiser
    steps on rank zero (straight to the trainer's loggers: no value is reduced or read back from the device),
    and keeps their run averages for results.json (``summary``)."""

    summary_key = "throughput"  # where results.json's fit section holds the summary (evaluation.results)

    def __init__(self) -> None:
        # the window and the run's totals are set by on_train_start, before any batch
        self._window: dict[str, float] = {}
        self._run: dict[str, float] | None = None
        self._first: dict[str, float] | None = None
        self._batch_end: float | None = None
        self._step_images = 0  # this rank's images of the step in progress

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"images": 0, "job_images": 0, "steps": 0, "wait": 0.0, "seconds": 0.0}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run = self._zero()
        self._first = None
        self._open_window()  # a fit resumed mid-epoch starts without on_train_epoch_start

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a window never spans validation or checkpointing: the previous epoch's unfinished one is dropped
        self._open_window()

    def _open_window(self) -> None:
        self._window = self._zero()
        self._window_start = self._batch_end = time.perf_counter()  # the first batch's wait counts from here

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        if self._batch_end is not None:
            self._window["wait"] += time.perf_counter() - self._batch_end
        self._step_before = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: object, batch_idx: int
    ) -> None:
        images = len(batch["label"]) if isinstance(batch, dict) and "label" in batch else 0
        self._window["images"] += images
        self._step_images += images
        stepped = trainer.global_step != self._step_before
        self._window["steps"] += int(stepped)
        if stepped:  # the whole job's images of the step: the global batch (else this rank's as every rank's)
            global_batch = global_batch_of(trainer)
            self._window["job_images"] += (
                global_batch.images if global_batch else self._step_images * trainer.world_size
            )
            self._step_images = 0
        if stepped and trainer.global_step % max(1, log_every_n_steps(trainer)) == 0:
            self._close_window(trainer, pl_module)
        self._batch_end = time.perf_counter()

    def _close_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            _synchronize(pl_module.device)  # the interval's work is done: its time is exact
        now = time.perf_counter()
        window, self._window = self._window, self._zero()
        window["seconds"] = now - self._window_start
        self._window_start = now
        if self._first is None:
            self._first = window
        else:
            assert self._run is not None  # on_train_start set it
            for key in self._run:
                self._run[key] += window[key]
        if trainer.is_global_zero and window["steps"]:
            values = self.figures(window)
            for logger in trainer.loggers:
                logger.log_metrics({f"perf/{k}": v for k, v in values.items()}, step=trainer.global_step)

    @staticmethod
    def figures(totals: dict[str, float]) -> dict[str, float]:
        seconds = max(totals["seconds"], 1e-9)
        return {
            "images_per_s": totals["images"] / seconds,
            "job_images_per_s": totals["job_images"] / seconds,
            "step_seconds": seconds / max(totals["steps"], 1),
            "data_wait_share": min(1.0, totals["wait"] / seconds),
        }

    def summary(self) -> dict[str, float] | None:
        """The run's figures over its logging intervals (the first left out when there are others), with the
        intervals' steps and images; None before one interval has ended."""
        totals = self._run if self._run and self._run["steps"] else self._first
        if not totals or not totals["steps"]:
            return None
        return {
            **{k: round(v, 4) for k, v in self.figures(totals).items()},
            "steps": int(totals["steps"]),
            "images_per_device": int(totals["images"]),
        }
