"""Where the project's data files live, and where a run's outputs go."""

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

REPO_ROOT = Path(__file__).resolve().parents[1]

# data/ of the checkout holds the class maps and subsets (see data/PROVENANCE.md) and the generated synthetic
# dataset; ROBUST_LIGHTNING_DATA points elsewhere, e.g. on a cluster where the checkout is read-only.
DATA_DIR = Path(os.environ.get("ROBUST_LIGHTNING_DATA", REPO_ROOT / "data"))


def run_directory(trainer: "Trainer", every_rank: bool = False) -> Path:
    """Where a run's results.json, plots, predictions and evaluation outcomes go: its first logger's directory
    (version_N of a CSV or TensorBoard logger, another logger's save_dir), trainer.default_root_dir without one.
    The rule of Lightning's ``Trainer.log_dir``, which writes config.yaml there.

    every_rank: every rank calls this at the same point and needs rank zero's answer (another rank's CSV logger
    may number its version otherwise): ``Trainer.log_dir`` itself, which broadcasts it. Otherwise there is no
    collective: for a writer on rank zero alone, or ranks that may be at different points."""
    if every_rank:
        return Path(trainer.log_dir or trainer.default_root_dir)
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: PLC0415 (this module stays light)

    logger = trainer.loggers[0] if trainer.loggers else None
    if logger is None:
        return Path(trainer.default_root_dir)
    directory = logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
    return Path(directory or trainer.default_root_dir)
