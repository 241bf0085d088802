"""A fit owns its run directory and its checkpoint directory while it runs, and its checkpoints afterwards.

- While a fit runs, it holds the lock of its run directory (and of ``checkpoint.dirpath`` where that lies
  elsewhere): a second fit into either stops at once with a message naming the first.
- A fixed ``checkpoint.dirpath`` outside the run directory (the quickstart's and the recipes') records the run
  directory whose checkpoints it holds (``.run_directory``). A fit in another run directory is refused there:
  its last.ckpt would replace the earlier run's, whose results.json would then hash weights no longer its own.
  Resuming (``--ckpt_path last``) continues in the recorded run directory, so it is not refused; a resume by
  path from a new run directory is (the earlier run's results.json would no longer match its checkpoints).
- The run directory of a fit is marked (``.fit``, naming its checkpoint directory): ``--ckpt_path last`` looks
  only at run directories so marked, never at one a validate or test created
  (``continue_in_latest_run_directory``), and starts from the newest intact checkpoint there.
- Its log goes to disk with each checkpoint (robust_lightning.loggers.CSVLogger.checkpoint_saved), and a fit
  stopped by SIGTERM logs the row of the step it stopped at, whose checkpoint it wrote.
"""

import itertools
import json
import shutil
import zipfile
from contextlib import ExitStack
from pathlib import Path

from lightning import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from robust_lightning.atomic import atomic_write_json
from robust_lightning.errors import UserError
from robust_lightning.locking import LOCK_NAME, exclusive
from robust_lightning.loggers import CSVLogger as ContinuedCSVLogger
from robust_lightning.loggers import logger_class
from robust_lightning.paths import run_directory

FIT_MARKER = ".fit"  # in a fit's run directory: {"checkpoint_dirpath": ...}
OWNER_MARKER = ".run_directory"  # in a checkpoint directory outside its run: {"run_directory": ...}


def _read_json(path: Path) -> dict | None:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def fit_checkpoint_directory(run_dir: Path) -> Path | None:
    """The checkpoint directory of the fit that ran in ``run_dir``, or None if no fit ran there. Run
    directories written before the marker existed count as a fit's when they hold checkpoints/last.ckpt."""
    marker = _read_json(run_dir / FIT_MARKER)
    if marker and marker.get("checkpoint_dirpath"):
        return Path(marker["checkpoint_dirpath"])
    return run_dir / "checkpoints" if (run_dir / "checkpoints" / "last.ckpt").is_file() else None


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


class FitRunDirectory(Callback):
    """Claims the run and checkpoint directories of a fit (see the module docstring); global rank zero only."""

    def __init__(self):
        self._locks = ExitStack()

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        run_dir = run_directory(trainer, every_rank=True).resolve()
        if not trainer.is_global_zero:
            return
        checkpoint = trainer.checkpoint_callback
        dirpath = checkpoint.dirpath if isinstance(checkpoint, ModelCheckpoint) else None
        # Lightning puts checkpoints without a dirpath into <log_dir>/checkpoints
        checkpoints = Path(dirpath).resolve() if dirpath else run_dir / "checkpoints"
        try:
            elsewhere = not _inside(checkpoints, run_dir)
            if elsewhere:  # first: a refused fit leaves no run directory behind
                self._locks.enter_context(exclusive(checkpoints / LOCK_NAME, f"checkpoint directory {checkpoints}"))
                resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path else None
                self._check_owner(checkpoints, run_dir, resumed is not None and _inside(resumed, checkpoints))
            self._locks.enter_context(exclusive(run_dir / LOCK_NAME, f"run directory {run_dir}"))
            if elsewhere:
                atomic_write_json(checkpoints / OWNER_MARKER, {"run_directory": str(run_dir)})
            atomic_write_json(run_dir / FIT_MARKER, {"checkpoint_dirpath": str(checkpoints)})
        except BaseException:
            self._locks.close()
            if run_dir.is_dir() and not any(run_dir.iterdir()):  # a refused fit leaves no empty version_N behind
                run_dir.rmdir()
            raise

    @staticmethod
    def _check_owner(checkpoints: Path, run_dir: Path, continues_them: bool) -> None:
        """Refuse a checkpoint directory that holds another run's checkpoints.
        ``continues_them``: this fit resumes from one of them, which makes checkpoints saved before the owner was
        recorded (no marker) its own."""
        owner = (_read_json(checkpoints / OWNER_MARKER) or {}).get("run_directory")
        advice = (
            f"resume that run with --ckpt_path last, set checkpoint.dirpath to a new directory, or delete "
            f"{checkpoints} to start over"
        )
        if owner is not None and Path(owner) != run_dir:
            raise UserError(
                f"checkpoint.dirpath {checkpoints} holds the checkpoints of the run in {owner}, not of "
                f"this run ({run_dir}); a new fit there would overwrite them: {advice}"
            )
        if owner is None and not continues_them and any(checkpoints.glob("*.ckpt")):
            raise UserError(
                f"checkpoint.dirpath {checkpoints} holds checkpoints of an earlier run; a new fit there "
                f"would overwrite them: {advice}"
            )

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._locks.close()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, ContinuedCSVLogger):
                logger.checkpoint_saved()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._locks.close()
        # Stopped by SIGTERM at the end of a training step (training/interruption.py), which is checkpointed and
        # will not be trained again: its row, which Lightning logs after the step's end hooks, is logged here.
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        if isinstance(exception, SIGTERMException) and trainer.training and progress.processed > progress.completed:
            trainer._logger_connector.update_train_step_metrics()


def newest_intact_checkpoint(directory: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint a resume should start from: last.ckpt, or else the newest other checkpoint of ``directory``,
    provided it reads to its end (a torch checkpoint is a zip archive, whose directory is at the end: a cut file
    has none). Returns it (None when there is none) and a note on each newer one passed over."""
    if not directory.is_dir():
        return None, []
    files = [p for p in directory.glob(f"*{ModelCheckpoint.FILE_EXTENSION}") if not p.name.startswith(".")]
    last = [p for p in files if p.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST)]
    others = sorted(set(files) - set(last), key=lambda p: p.stat().st_mtime, reverse=True)
    passed = []
    for candidate in sorted(last, key=lambda p: p.stat().st_mtime, reverse=True) + others:
        try:
            with zipfile.ZipFile(candidate):
                return candidate, passed
        except (zipfile.BadZipFile, OSError) as e:
            passed.append(f"{candidate.name} is damaged ({type(e).__name__}: {e})")
    return None, passed


def continue_in_latest_run_directory(config) -> None:
    """``fit --ckpt_path last`` continues a run in its own directory, whatever the moment it stopped.

    The run-directory logger (the first; CSV or TensorBoard) without an explicit version takes the newest
    version_N that a fit wrote (not one a validate or test created) instead of opening a new one, so the
    checkpoint search, the logs and results.json all stay with the run being resumed (a requeued or killed job
    continues where it was). Other CSV or TensorBoard loggers take their newest version_N (a W&B logger's
    ``version`` is its run id: the run directory keeps it, robust_lightning.loggers.WandbLogger). The CSV log
    continues (robust_lightning.loggers.CSVLogger); a copy of it as the earlier attempts left it is kept as
    metrics.partN.csv. The fit then starts from the
    newest intact checkpoint of that run (``newest_intact_checkpoint``); with none (the run stopped before its
    first checkpoint, or there was no earlier run), it says so and starts afresh in the same run directory:
    Lightning alone would warn and silently start from scratch in a new one."""
    loggers = config.trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    run_dir = None
    for index, logger in enumerate(loggers):
        init, kind = getattr(logger, "init_args", None), logger_class(logger)
        if init is None or not (kind and issubclass(kind, (CSVLogger, TensorBoardLogger))):
            continue
        runs = Path(init.save_dir) / (init.get("name") or "")  # no name: versions directly in save_dir
        if init.version is not None:
            if index == 0:
                run_dir = runs / (init.version if isinstance(init.version, str) else f"version_{init.version}")
            continue
        versions = [
            int(p.name[len("version_") :])
            for p in runs.glob("version_*")
            if p.name[len("version_") :].isdigit() and (index > 0 or fit_checkpoint_directory(p) is not None)
        ]
        if not versions and index == 0:
            rank_zero_info(f"--ckpt_path last: no earlier fit of this config in {runs}; starting one")
            config.ckpt_path = None
            return
        if versions:
            init.version = max(versions)
            run_dir = run_dir or runs / f"version_{init.version}"
            # the log continues in metrics.csv; a copy as the earlier attempts left it, named as before
            metrics = runs / f"version_{init.version}" / "metrics.csv"
            if metrics.is_file() and rank_zero_only.rank == 0:
                part = next(k for k in itertools.count(1) if not metrics.with_name(f"metrics.part{k}.csv").exists())
                shutil.copyfile(metrics, metrics.with_name(f"metrics.part{part}.csv"))
    dirpath = config.get("checkpoint.dirpath")
    if dirpath:
        checkpoints = Path(dirpath)
    elif run_dir is not None:
        checkpoints = fit_checkpoint_directory(run_dir) or run_dir / "checkpoints"
    elif config.trainer.get("logger") is False:
        checkpoints = Path(config.trainer.get("default_root_dir") or ".") / "checkpoints"
    else:
        return  # Lightning's default logger: its directory is not known before it is created
    chosen, passed = newest_intact_checkpoint(checkpoints)
    where = f" (the run in {run_dir})" if run_dir is not None else ""
    notes = "".join(f"; {note}" for note in passed)
    if chosen is None:
        rank_zero_info(
            f"--ckpt_path last: no intact checkpoint in {checkpoints}{where}{notes}: the run stopped "
            "before its first one, so it starts afresh in the same run directory"
        )
        config.ckpt_path = None
    elif passed or not chosen.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST):
        rank_zero_info(f"--ckpt_path last: resuming from {chosen}, the newest intact checkpoint{where}{notes}")
        config.ckpt_path = str(chosen)
