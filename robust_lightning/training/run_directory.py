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
  (``continue_in_latest_run_directory``), and starts from the checkpoint furthest in training there
  (``resume_checkpoint``), SLURM's hpc checkpoints of the run among them.
- Its log goes to disk with each checkpoint (robust_lightning.loggers.CSVLogger.checkpoint_saved), and a fit
  stopped by SIGTERM logs the row of the step it stopped at, whose checkpoint it wrote.
- A command refused before its loops ran a batch (exit status 2: a refusal here, a config value the data module or
  the model rejects, an incompatible checkpoint) takes back the run folders it made and the files it added to
  folders that were there before (``discard_refused_run``): no empty or half-filled version_N stays behind to push
  the next run to a later number, and an earlier run's folder (the one a refused ``--ckpt_path last`` was to
  continue) is left as it was.
"""

import itertools
import json
import os
import shutil
import sys
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import Namespace
from lightning import Callback
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from robust_lightning.atomic import atomic_write_json
from robust_lightning.errors import UserError
from robust_lightning.locking import LOCK_NAME, exclusive
from robust_lightning.loggers import CSVLogger as ContinuedCSVLogger
from robust_lightning.loggers import WandbLogger as ContinuedWandbLogger
from robust_lightning.loggers import finish_wandb_run, logger_class
from robust_lightning.paths import run_directory

LOGGED_ROWS = "metrics_csv_rows"  # in a fit's checkpoint: how many rows its run's metrics.csv held then
FIT_MARKER = ".fit"  # in a fit's run directory: {"checkpoint_dirpath": ...}
OWNER_MARKER = ".run_directory"  # in a checkpoint directory outside its run: {"run_directory": ...}


def _read_json(path: Path) -> dict[str, Any] | None:
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


class _CommandRecord:
    """What the command in progress made, which it takes back when it is refused (``discard_refused_run``)."""

    def __init__(self) -> None:
        self.directories: set[str] = set()  # the folders this process made since the command began (real paths)
        self.files: list[Path] = []  # the files it added to folders that were there before it
        self.folders: list[Path] = []  # its run folders, noted where it stopped (rank zero)
        self.wandb_folders: list[Path] = []  # the folders of the W&B runs its loggers started, noted with them
        self.exception: BaseException | None = None  # what stopped it inside the Trainer
        self.begun = False  # a loop ran a batch: a failure after that leaves the run's folder as it is
        self.ckpt_path: str | None = None  # the checkpoint a fit resumes from (note_resumed_checkpoint)


_command: _CommandRecord | None = None
_audit_hook_added = False


def _real_path(path: str | os.PathLike[str]) -> str:
    """``path`` with the folders above it resolved (the last part as named: it may not exist yet)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _note_made_folder(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook (``sys.addaudithook``): the folders this process makes while a command runs, by whichever code
    (the loggers, Lightning's config saving, the locks). It runs before the folder is made: one that is there
    already (``os.makedirs(exist_ok=True)`` calls mkdir all the same) is not noted."""
    command = _command
    if event != "os.mkdir" or command is None:
        return
    try:
        path, _mode, dir_fd = args
        if dir_fd in (None, -1) and not os.path.lexists(path):
            command.directories.add(_real_path(os.fsdecode(path)))
    except Exception:  # noqa: BLE001 (an audit hook must never fail the call it watches)
        pass


def _begin_command() -> None:
    """A Trainer command begins (robust_lightning.cli makes its callbacks, FitRunDirectory among them, first)."""
    global _command, _audit_hook_added
    if not _audit_hook_added:
        sys.addaudithook(_note_made_folder)  # once per process: an audit hook cannot be removed
        _audit_hook_added = True
    _command = _CommandRecord()


def note_resumed_checkpoint(ckpt_path: str | None) -> None:
    """The checkpoint the command's fit resumes from, as the command line resolved it: Lightning sets
    ``trainer.ckpt_path`` only after the setup hooks, where FitRunDirectory needs it."""
    if _command is not None:
        _command.ckpt_path = ckpt_path


def _note_added_file(path: Path) -> None:
    """``path``, about to be written, is new: a refusal removes it (its folder may be an earlier run's)."""
    if _command is not None and not path.exists():
        _command.files.append(path)


def _run_folders(trainer: pl.Trainer) -> list[Path]:
    """The folders a command writes its run into: its run directory, every CSV or TensorBoard logger's version
    folder, the checkpoint directory."""
    folders = [run_directory(trainer)]
    folders += [Path(lg.log_dir) for lg in trainer.loggers if isinstance(lg, (CSVLogger, TensorBoardLogger))]
    checkpoint = trainer.checkpoint_callback
    if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath and "://" not in str(checkpoint.dirpath):
        folders.append(Path(checkpoint.dirpath))
    return folders


def _wandb_folders(trainer: pl.Trainer) -> list[Path]:
    """The folders of the W&B runs the trainer's loggers started (``<save_dir>/wandb/offline-run-...``)."""
    folders = []
    for logger in trainer.loggers:
        run = getattr(logger, "_experiment", None) if isinstance(logger, WandbLogger) else None
        run_files = getattr(run, "dir", None)  # <run folder>/files
        if run_files and "://" not in str(run_files):
            folders.append(Path(run_files).parent)
    return folders


def _written_by_another(folder: Path) -> bool:
    """Whether another process holds the lock of ``folder`` (a fit that took the same version number)."""
    if not (folder / LOCK_NAME).is_file():
        return False
    try:
        with exclusive(folder / LOCK_NAME, str(folder)):
            return False
    except UserError:
        return True


def discard_refused_run(exception: BaseException) -> None:
    """The command ends refused by ``exception`` (exit status 2; robust_lightning.cli): the run folders it made go
    (version_N with its hparams.yaml, config.yaml and lock; a checkpoint directory; the folders above them it made
    and left empty), and so do the files it added to folders that were there before (an owner marker, the copy of
    a continued log). Nothing is taken back when its loops ran a batch (a run that failed keeps what it wrote),
    when another exception stopped it, or from a folder another process is writing."""
    global _command
    command, _command = _command, None
    if command is None or command.begun or (command.exception is not None and command.exception is not exception):
        return
    for path in command.files:
        with suppress(OSError):
            path.unlink()
    wandb_folders = [Path(_real_path(folder)) for folder in command.wandb_folders]
    if any(str(folder) in command.directories for folder in wandb_folders):
        finish_wandb_run(2)  # W&B's service writes what it holds into the run's folder, then lets it go
    for folder in [*command.folders, *wandb_folders]:
        folder = Path(_real_path(folder))
        if str(folder) in command.directories and folder.is_dir() and not _written_by_another(folder):
            shutil.rmtree(folder, ignore_errors=True)
            for link in folder.parent.iterdir():  # W&B's latest-run and debug logs pointing into it
                if link.is_symlink() and not link.exists():
                    link.unlink()
        for parent in folder.parents:  # runs/<name>/ of a first run, made for the refused one alone
            if str(parent) not in command.directories:
                break
            try:
                parent.rmdir()
            except OSError:  # not empty (another folder of the command in it): it stays
                break


class FitRunDirectory(Callback):
    """Claims the run and checkpoint directories of a fit (see the module docstring); global rank zero only.
    Every Trainer command of the command line has one: it keeps the record of what a refused command takes back
    (``discard_refused_run``)."""

    def __init__(self) -> None:
        self._locks = ExitStack()
        self._logged_rows: int | None = None  # of the checkpoint the fit resumes from
        _begin_command()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
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
                resumed = _command.ckpt_path if _command is not None else None
                continues_them = resumed is not None and _inside(Path(resumed).resolve(), checkpoints)
                self._check_owner(checkpoints, run_dir, continues_them)
            self._locks.enter_context(exclusive(run_dir / LOCK_NAME, f"run directory {run_dir}"))
            if elsewhere:
                _note_added_file(checkpoints / OWNER_MARKER)
                atomic_write_json(checkpoints / OWNER_MARKER, {"run_directory": str(run_dir)})
            _note_added_file(run_dir / FIT_MARKER)
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

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        global _command
        self._locks.close()
        _command = None  # the command ended: nothing to take back

    def _begin_work(self) -> None:
        if _command is not None:
            _command.begun = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self._begin_work()

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin_work()

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin_work()

    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._begin_work()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, ContinuedCSVLogger):
                rows = logger.checkpoint_saved()
                if logger is trainer.loggers[0] and rows is not None:  # the run's log (rank zero writes the file)
                    checkpoint[LOGGED_ROWS] = rows

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._logged_rows = checkpoint.get(LOGGED_ROWS)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A resumed fit first sends W&B the rows of the run's log up to its checkpoint that the earlier attempts'
        W&B records lack (robust_lightning.loggers.WandbLogger.send_rows_it_lacks), even where it has nothing left to
        train (a fit stopped in its end-of-fit evaluation)."""
        rows, self._logged_rows = self._logged_rows, None
        first = trainer.loggers[0] if trainer.loggers else None
        if not rows or not trainer.is_global_zero or not isinstance(first, ContinuedCSVLogger):
            return
        for logger in trainer.loggers:
            if isinstance(logger, ContinuedWandbLogger):
                logger.send_rows_it_lacks(Path(first.experiment.metrics_file_path), rows)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._locks.close()
        if _command is not None:  # for discard_refused_run, should the command end refused
            _command.exception = exception
            try:
                _command.folders = _run_folders(trainer) if trainer.is_global_zero else []
            except Exception:  # noqa: BLE001 (the error that stopped the command is the one to report)
                _command.folders = []
            _command.wandb_folders = _wandb_folders(trainer)


HPC_CHECKPOINT = "hpc_ckpt_"  # what Lightning looks for in a file's name (_CheckpointConnector._hpc_resume_path)


def _hpc_files(default_root_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The files named ``*hpc_ckpt_*`` in ``trainer.default_root_dir`` (the working directory when unset), where
    Lightning writes a fit's checkpoint at SLURM's requeue. A remote folder (``s3://...``) is taken to hold none."""
    root = str(default_root_dir or os.getcwd())
    if "://" in root or not Path(root).is_dir():
        return []
    return sorted(entry for entry in Path(root).iterdir() if HPC_CHECKPOINT in entry.name)


def hpc_checkpoints(default_root_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The hpc checkpoints Lightning, given no ckpt_path, resumes a fit from by itself (the one numbered highest):
    those of ``default_root_dir`` under srun (its SLURM environment detected), none elsewhere. The same condition as
    Lightning 2.6's ``_CheckpointConnector._parse_ckpt_path``."""
    return _hpc_files(default_root_dir) if SLURMEnvironment.detect() else []


def _checkpoint_folders(checkpoint: dict[str, Any]) -> set[Path]:
    """The folders of the checkpoint callbacks whose state ``checkpoint`` holds: those of the fit that wrote it."""
    states = checkpoint.get("callbacks") or {}
    return {Path(s["dirpath"]).resolve() for s in states.values() if isinstance(s, dict) and s.get("dirpath")}


def resume_checkpoint(
    checkpoints: Path, default_root_dir: str | os.PathLike[str] | None
) -> tuple[Path | None, str, str]:
    """The checkpoint a resume of a run starts from: the one furthest in training.

    The candidates are every checkpoint of the run's checkpoint folder and the hpc checkpoints that Lightning writes
    into ``default_root_dir`` at SLURM's requeue. An hpc checkpoint counts only where its checkpoint callback's
    folder is ``checkpoints``, because a default_root_dir that several runs share holds theirs too. The checkpoint
    with the highest ``global_step`` wins, whatever its kind: a later attempt may have stopped without a requeue
    (SIGTERM's last.ckpt, a step checkpoint) after an earlier one was requeued, or the other way round. Of those at
    that step, the one written last wins: one saved at the end of a validation comes after one saved at that step
    before it, and a resume from it does not validate again. A file that does not load (cut short, or no
    checkpoint) is passed over.

    Returns the checkpoint (None where no candidate is left), why it was chosen, and a note on each file passed
    over, as parts of a message."""
    files = sorted(p for p in checkpoints.glob(f"*{ModelCheckpoint.FILE_EXTENSION}") if not p.name.startswith("."))
    ours = {p.resolve() for p in files}
    hpc = [p for p in _hpc_files(default_root_dir) if p.resolve() not in ours]  # the recipes': one folder for both
    found: list[tuple[int, int, Path]] = []
    notes = ""
    for path in files + hpc:
        try:  # mmap: the tensors stay on disk, only the pickled structure around them is read
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            step = int(checkpoint["global_step"])
        except Exception as e:  # noqa: BLE001 (a file that does not load, whatever the reason, is no place to resume)
            notes += f"; {path.name} is damaged ({type(e).__name__}: {str(e).split('. ')[0]})"
            continue
        if path in hpc and checkpoints.resolve() not in _checkpoint_folders(checkpoint):
            notes += f"; {path} is another run's (its checkpoints are not in {checkpoints})"
            continue
        found.append((step, path.stat().st_mtime_ns, path))
    if not found:
        return None, "", notes
    step, _, chosen = max(found)
    tie = "; of those at that step, the one saved last" if sum(s == step for s, _, _ in found) > 1 else ""
    why = (
        f"the newest intact checkpoint by training step (step {step}, the highest of its {len(found)} checkpoints{tie})"
    )
    return chosen, why, notes


def continue_in_latest_run_directory(config: Namespace) -> None:
    """``fit --ckpt_path last`` continues a run in its own directory, whatever the moment it stopped.

    The run-directory logger (the first; CSV or TensorBoard) without an explicit version takes the newest
    version_N that a fit wrote (not one a validate or test created) instead of opening a new one, so the
    checkpoint search, the logs and results.json all stay with the run being resumed (a requeued or killed job
    continues where it was). Other CSV or TensorBoard loggers take their newest version_N (a W&B logger's
    ``version`` is its run id: the run directory keeps it, robust_lightning.loggers.WandbLogger). The CSV log
    continues (robust_lightning.loggers.CSVLogger); a copy of it as the earlier attempts left it is kept as
    metrics.partN.csv. The fit then starts from the checkpoint of that run furthest in training, whatever its kind
    (``resume_checkpoint``), and says which and why; with none (the run stopped before its first checkpoint, or
    there was no earlier run), it says so and starts afresh in the same run directory: Lightning alone would warn
    and silently start from scratch in a new one. Where Lightning would take an hpc checkpoint by itself instead
    (under SLURM, given no ckpt_path), the command is refused."""
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
            # the rank Lightning sets on the function
            if metrics.is_file() and rank_zero_only.rank == 0:  # type: ignore[attr-defined]
                part = next(k for k in itertools.count(1) if not metrics.with_name(f"metrics.part{k}.csv").exists())
                _note_added_file(metrics.with_name(f"metrics.part{part}.csv"))
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
    root = config.trainer.get("default_root_dir")
    chosen, why, notes = resume_checkpoint(checkpoints, root)
    where = f" (the run in {run_dir})" if run_dir is not None else ""
    if chosen is not None:
        rank_zero_info(f"--ckpt_path last: resuming from {chosen}, {why}{where}{notes}")
        config.ckpt_path = str(chosen)
        return
    lightnings = hpc_checkpoints(root)
    if lightnings:  # Lightning, given no ckpt_path under SLURM, would resume from one of them all the same
        raise UserError(
            f"--ckpt_path last: no checkpoint of this run to resume from in {checkpoints}{where}{notes}; under "
            f"SLURM, Lightning would resume from {lightnings[0].parent}'s hpc_ckpt_N.ckpt by itself: move those "
            "files away to start the run afresh, or name a checkpoint with --ckpt_path"
        )
    rank_zero_info(
        f"--ckpt_path last: no intact checkpoint in {checkpoints}{where}{notes}: the run stopped "
        "before its first one, so it starts afresh in the same run directory"
    )
    config.ckpt_path = None
