"""Typed reads of the Trainer attributes that Lightning's connectors set in ``Trainer.__init__`` and the Trainer
class does not declare, so that mypy knows none of them: ``datamodule`` (the data connector), ``callbacks`` (the
callback connector) and ``log_every_n_steps`` (the logger connector). Each is read here, in one place, with its
type."""

import lightning.pytorch as pl


def datamodule_of(trainer: pl.Trainer) -> pl.LightningDataModule | None:
    """The data module of the running fit, validate, test or predict; None where it was given data loaders."""
    datamodule: pl.LightningDataModule | None = trainer.datamodule  # type: ignore[attr-defined]  # undeclared
    return datamodule


def callbacks_of(trainer: pl.Trainer) -> list[pl.Callback]:
    """The trainer's callbacks, the ones Lightning adds (progress bar, checkpoint, ...) included."""
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]  # undeclared (module docstring)
    return callbacks


def log_every_n_steps(trainer: pl.Trainer) -> int:
    """The optimiser steps between two logging steps (``trainer.log_every_n_steps``)."""
    steps: int = trainer.log_every_n_steps  # type: ignore[attr-defined]  # undeclared (module docstring)
    return steps
