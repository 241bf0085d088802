"""The complete run config in W&B, and summaries that keep the best validation scores.

LightningCLI writes config.yaml into the run directory, but a WandbLogger only receives the hyperparameters of the
model and the data module. ``SaveConfigToWandb`` also puts the whole parsed config (trainer, model, data, callbacks,
checkpoint, ckpt_path, seed) into the config of every W&B run, flattened to the command line's own key
names (``trainer.max_epochs``, ``model.attack_steps``, ``data.image_size``), so a W&B dashboard can filter and group
runs by any option, and stores the exact YAML with the run's files (``lightning_config.yaml``).

One training is one log however many attempts it takes (a requeue, ``--ckpt_path last``, a restart). Every command
uses the project's ``CSVLogger`` and ``WandbLogger`` where a config names Lightning's (``use_project_loggers``):

- ``CSVLogger`` continues the run directory's metrics.csv, where Lightning's deletes it: each attempt appends its
  rows (a row of a step trained again after a resume appears once per attempt that trained it), the header gains
  the columns a later attempt adds, and the rows logged up to a checkpoint are on disk (fsynced) with it
  (``checkpoint_saved``), so even ``kill -9`` loses only rows of steps that will be trained again.
- ``WandbLogger`` keeps its W&B run in the run directory (``wandb_run.json``: the run's id, the best value of each
  ``BEST_IS_MAX`` score): every attempt resumes that run, and the summaries keep the best value over all attempts.
  Each attempt continues the run's history where the earlier ones left it (``_step``), offline too, where W&B
  starts every attempt at 0; and a resumed fit first sends W&B the rows of metrics.csv up to its checkpoint that
  the earlier attempts' records lack (those a W&B service killed with the job never wrote). So the record files
  of a run's attempts hold every row once, in order, and ``wandb sync`` uploads them as one history.
"""

import argparse
import csv
import importlib
import itertools
import json
import os
import sys
from collections import Counter
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, cast

import yaml
from jsonargparse import Namespace
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from robust_lightning.atomic import atomic_write, atomic_write_json
from robust_lightning.job_signals import JobSignals
from robust_lightning.wandb_records import history_rows, read_records, run_record_files

# not config.yaml: W&B keeps its own run config under that name in the same folder
WANDB_CONFIG_FILE = "lightning_config.yaml"
# validation scores whose W&B summary is their best value over the run (W&B's default is the last)
BEST_IS_MAX = ("val/select_acc", "val/robust_acc", "val_ema/robust_acc", "val/acc1", "val_ema/acc1")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to one level with dotted keys (lists, e.g. of callbacks, stay values)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class SaveConfigToWandb(SaveConfigCallback):
    """LightningCLI's SaveConfigCallback (config.yaml in ``trainer.log_dir``), plus the full config in each W&B run."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        first = trainer.loggers[0] if trainer.loggers else None
        per_run = isinstance(first, (LightningCSVLogger, TensorBoardLogger))
        if first is not None and not per_run and not self.already_saved:
            # trainer.log_dir is then the first logger's bare save_dir, shared by every run: config.yaml and
            # results.json of one run would overwrite (or merge into) another's. The W&B copy stays per run.
            rank_zero_warn(
                f"the first logger ({type(first).__name__}) has no per-run directory: config.yaml and "
                f"results.json go to {first.save_dir} for every run. List a CSVLogger first "
                "(configs/loggers/wandb.yaml does)."
            )
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:  # rank zero only
        wandb_loggers = [logger for logger in trainer.loggers if isinstance(logger, LightningWandbLogger)]
        if not wandb_loggers:
            return
        text = self.parser.dump(self.config, skip_none=False)  # what config.yaml holds
        config = flatten(yaml.safe_load(text))
        for logger in wandb_loggers:
            logger.log_hyperparams(config)
            run = logger.experiment
            for name in BEST_IS_MAX:  # the run's summary keeps the best value and the last (W&B's default)
                run.define_metric(name, step_metric="trainer/global_step", step_sync=True, summary="max,last")
            if Path(run.dir).is_dir():  # not with WANDB_MODE=disabled: no files then
                path = Path(run.dir) / WANDB_CONFIG_FILE
                path.write_text(text)
                run.save(str(path), base_path=run.dir, policy="now")


def open_wandb_run() -> Any:
    """The W&B run open in this process (``wandb.run``); None where there is none (wandb not even imported)."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


def finish_wandb_run(exit_code: int, already_open: Any = None) -> None:
    """Finish the W&B run that a command started (none open, or only ``already_open``: nothing to do), with the
    command's exit status, as W&B's own exit would. Finished from Python, W&B prints its closing lines (where the run
    is, ``wandb sync``) as plain text where the output is no terminal; left to the process's exit, the wandb-core
    process prints them, with colour codes even into a log file. After a job's stop signal, which may have ended
    W&B's service process too, a failure is a warning (:func:`_wandb_failed`)."""
    run = open_wandb_run()
    if run is None or run is already_open:
        return
    try:
        run.finish(exit_code=exit_code)
    except Exception as e:  # noqa: BLE001 (re-raised unless a job signal explains it)
        _wandb_failed(e, "could not finish its run")
        # W&B's exit hook would try the lost connection again and print its traceback; its teardown removes it
        with suppress(Exception):
            sys.modules["wandb"].teardown()


def end_wandb_before_job_signal(exit_code: int) -> None:
    """Finish the W&B run open in this process and shut W&B's wandb-core process down, before a signal to every
    process of the job (SLURM's SIGTERM after a requeue) kills wandb-core, which dies without writing what it
    holds (wandb/wandb issue 9963); W&B's exit handler would then fail on the lost connection."""
    finish_wandb_run(exit_code)
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        try:
            wandb.teardown()
        except Exception as e:  # noqa: BLE001 (re-raised unless a job signal explains it)
            _wandb_failed(e, "could not shut its service down")


_wandb_failures: list[str] = []  # what W&B could not do after a job signal, warned of once


def _wandb_failed(error: Exception, what: str) -> None:
    """A failure of W&B: an error, except after the job's stop signal. SLURM signals every process of the job,
    W&B's service process (wandb-core) included, which dies of SIGTERM without writing what it holds (wandb/wandb
    issue 9963); the run's rows are all in metrics.csv, and the next attempt sends W&B those it lacks
    (:class:`WandbLogger`). So the failure is a warning, given once, and the command still ends as a stopped one."""
    if not JobSignals.noted():
        raise error
    if not _wandb_failures:
        rank_zero_warn(
            f"W&B {what} after the job's stop signal ({type(error).__name__}: {error}); its service process "
            "probably ended with the job. metrics.csv holds every row, and the next attempt of the run sends W&B "
            "the rows it lacks."
        )
    _wandb_failures.append(what)


def hold_wandb_rows(loggers: list[Any]) -> list["WandbLogger"]:
    """The project's W&B loggers among ``loggers``, each keeping the rows logged from now on until
    :func:`send_held_wandb_rows`: a stopped fit logs its last step's row before its checkpoint is saved, and only
    the other loggers, which write to disk, get it then."""
    held = [logger for logger in loggers if isinstance(logger, WandbLogger)]
    for logger in held:
        logger._held = []
    return held


def send_held_wandb_rows(held: list["WandbLogger"]) -> None:
    for logger in held:
        rows, logger._held = logger._held or [], None
        for metrics, step in rows:
            logger.log_metrics(metrics, step)


def _signature(row: dict[str, Any]) -> tuple[Any, frozenset[str]]:
    """What identifies a history row of W&B as a row of metrics.csv: its step and its keys."""
    step = row.get("trainer/global_step")
    keys = frozenset(key for key in row if not key.startswith("_") and key != "trainer/global_step")
    return (int(step) if isinstance(step, (int, float)) else None, keys)


def _values(row: dict[str, str]) -> dict[str, Any]:
    """A metrics.csv row's filled cells as numbers (integers where written as such: the step, the epoch)."""
    values: dict[str, Any] = {}
    for key, text in row.items():
        if text in (None, ""):
            continue
        try:
            values[key] = int(text)
        except ValueError:
            values[key] = float(text)
    return values


# ------------------------------------------------------------------------------- one log across attempts
WANDB_RUN_FILE = "wandb_run.json"  # in the run directory: {"id": the W&B run, "best": {score: best value}}
# Lightning's loggers (as configs name them) -> the project's, which continue a run's log (use_project_loggers)
PROJECT_LOGGERS = {
    f"lightning.pytorch.loggers.{module}{name}": f"{__name__}.{name}"
    for name, modules in (("CSVLogger", ("", "csv_logs.")), ("WandbLogger", ("", "wandb.")))
    for module in modules
}


def use_project_loggers(config: Namespace) -> None:
    """Lightning's CSVLogger and WandbLogger in a parsed config (``trainer.logger``: one or a list) become the
    project's subclasses, with the same options: old configs and the shipped ones that name Lightning's keep
    working, and continue their logs across attempts."""
    loggers = config.trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        class_path = getattr(logger, "class_path", None)
        if class_path in PROJECT_LOGGERS:
            logger.class_path = PROJECT_LOGGERS[class_path]


def logger_class(logger: object) -> type | None:
    """The class a parsed logger entry (``class_path``) names; None for anything else."""
    module, _, name = str(getattr(logger, "class_path", "")).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return None


def _keep_whole_rows(path: Path) -> list[str]:
    """The columns of an existing metrics.csv, a last row cut short (a kill mid-write) removed; [] where there is no
    file or not even a whole header (then emptied)."""
    try:
        file = open(path, "r+b")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        return []
    with file:
        header = file.readline()
        if not header.endswith(b"\n"):
            file.truncate(0)
            return []
        size = file.seek(0, os.SEEK_END)
        start = max(len(header), size - (1 << 16))  # rows are far shorter
        file.seek(start)
        tail = file.read()
        if tail and not tail.endswith(b"\n"):
            file.truncate(start + tail.rfind(b"\n") + 1 if b"\n" in tail else len(header))
    return next(csv.reader([header.decode()]))


class _ContinuedMetrics(ExperimentWriter):
    """Lightning's metrics.csv writer, continuing an existing file instead of deleting it; ``rows`` counts the rows
    the file holds."""

    rows = 0

    def _check_log_dir_exists(self) -> None:  # Lightning's warns "will be deleted" and deletes metrics.csv here
        path = Path(self.metrics_file_path)
        self.metrics_keys = _keep_whole_rows(path)
        if self.metrics_keys:
            with open(path, newline="") as file:
                self.rows = sum(1 for _ in csv.DictReader(file))
            rank_zero_info(f"{path}: continuing the log of the earlier attempts (their rows are kept)")

    def save(self) -> None:
        written = len(self.metrics)
        super().save()
        self.rows += written

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        """A later attempt's new columns: the file written anew with the wider header, atomically (a kill
        leaves the old file whole)."""
        with open(self.metrics_file_path, newline="") as file:
            rows = list(csv.DictReader(file))
        with atomic_write(self.metrics_file_path) as file:
            writer = csv.DictWriter(file, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)


class CSVLogger(LightningCSVLogger):
    """Lightning's CSVLogger, continuing the run directory's metrics.csv across attempts (module docstring)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _ContinuedMetrics:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedMetrics(log_dir=self.log_dir)
        return cast(_ContinuedMetrics, self._experiment)  # made here (the base class types it as its own writer)

    @rank_zero_only
    def checkpoint_saved(self) -> int:
        """A checkpoint is being written (and fsynced): the rows logged so far go to disk with it, and their count
        is returned, for the checkpoint to record (the rows a fit resumed from it had logged). (The trainer writes
        each row it logs at once; rows logged straight to the logger, as the throughput's, wait for the next
        write.)"""
        self.save()
        with suppress(FileNotFoundError):  # nothing logged yet
            descriptor = os.open(self.experiment.metrics_file_path, os.O_RDONLY)
            try:
                os.fsync(descriptor)  # on disk, not only in the page cache: a node's crash keeps them too
            finally:
                os.close(descriptor)
        return int(self.experiment.rows)


class WandbLogger(LightningWandbLogger):
    """Lightning's WandbLogger, one W&B run per training however many attempts (module docstring). The command
    gives it the run directory (``keep_run_in``, on rank zero: the trainer's first logger's directory); without
    one, this is Lightning's logger. (It overrides neither ``__init__`` nor ``experiment``: the command line's
    options of wandb.init are read from Lightning's code of those.)"""

    _state: Path | None = None  # the run directory's WANDB_RUN_FILE
    _state_written = False
    _held: list[tuple[dict[str, Any], int | None]] | None = None  # rows kept back (hold_wandb_rows)
    _failed = False  # W&B failed after a job signal: nothing more is sent
    _next_step: int | None = None  # the history _step of this attempt's next row, once known
    _best: dict[str, float]
    _carried: frozenset[str] = frozenset()  # the scores whose best an earlier attempt logged

    def keep_run_in(self, run_dir: str | os.PathLike[str]) -> None:
        """Continue the W&B run kept in ``run_dir`` (its id), or keep there the new run started now. The file is
        written once this run logs (a fit refused before it starts leaves its run directory as it was)."""
        from wandb.sdk.lib.runid import generate_id  # noqa: PLC0415 (wandb loads only where it logs)

        self._state = Path(run_dir) / WANDB_RUN_FILE
        try:
            state = json.loads(self._state.read_text())
        except (OSError, ValueError):
            state = {}
        given = self._wandb_init.get("id") or os.environ.get("WANDB_RUN_ID")  # the user's choice wins
        run_id = given or state.get("id") or generate_id()
        self._best = dict(state.get("best") or {}) if state.get("id") == run_id else {}
        self._carried = frozenset(self._best)
        if state.get("id") == run_id:
            rank_zero_info(f"W&B: every attempt of the run in {run_dir} logs to the W&B run {run_id}")
        self._wandb_init["id"] = self._id = run_id
        self._wandb_init["resume"] = self._wandb_init.get("resume") or "allow"  # the parsed config gives None

    def _save_state(self) -> None:
        assert self._state is not None  # called with a state file only
        atomic_write_json(self._state, {"id": self._id, "best": self._best})
        self._state_written = True

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        super().log_hyperparams(params)
        if self._state is not None and not self._state_written:
            self._save_state()

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self._held is not None:
            self._held.append((dict(metrics), step))
            return
        if self._failed:
            return
        try:
            self._log_row(dict(_add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)), step)
            carried = self._note_best(metrics)
            if carried:  # W&B's max summary of a resumed run counts only the values logged since the resume
                self.experiment.summary.update(carried)
        except Exception as e:  # noqa: BLE001 (re-raised unless a job signal explains it)
            _wandb_failed(e, "could not log a row")
            self._failed = True

    def _log_row(self, row: dict[str, Any], step: int | None) -> None:
        """One history row, at the run's next ``_step`` (Lightning's logger leaves it to W&B, which starts every
        offline attempt at 0)."""
        if self._wandb_init.get("sync_tensorboard"):  # W&B takes its steps from TensorBoard then
            super().log_metrics(row, step)
            return
        if step is not None:
            row["trainer/global_step"] = step
        if self._next_step is None:
            earlier = self._earlier_history()
            after_earlier = max((row.get("_step", -1) for row in earlier), default=-1) + 1
            self._next_step = max(after_earlier, int(getattr(self.experiment, "step", 0) or 0))
        self.experiment.log(row, step=self._next_step, commit=True)
        self._next_step += 1

    def _earlier_history(self) -> list[dict[str, Any]]:
        """The history rows of this run that earlier attempts recorded in this W&B folder, oldest attempt first."""
        own = Path(self.experiment.dir).parent  # <W&B folder>/<this attempt's run folder>/files
        attempts = []
        for path in run_record_files(own.parent, self.experiment.id):
            if path.parent == own:
                continue
            try:
                records = read_records(path)
            except (OSError, ValueError):
                continue
            started = next((r.run.start_time.ToNanoseconds() for r in records if r.HasField("run")), 0)
            attempts.append((started, path.name, history_rows(records)))
        return [row for _, _, rows in sorted(attempts, key=lambda a: (a[0], a[1])) for row in rows]

    def send_rows_it_lacks(self, metrics_csv: Path, rows: int) -> int:
        """Send W&B the first ``rows`` rows of ``metrics_csv`` (those a resumed fit's checkpoint had logged) that
        the earlier attempts' records lack, in their order, before this attempt logs any; returns how many. A row
        counts as recorded where a history row has its step and its keys."""
        if rows <= 0 or self._state is None or not metrics_csv.is_file():
            return 0
        recorded = Counter(_signature(row) for row in self._earlier_history())
        with open(metrics_csv, newline="") as file:
            logged = [_values(row) for row in itertools.islice(csv.DictReader(file), rows)]
        missing = []
        for row in logged:
            step = row.pop("step", None)
            key = (step, frozenset(row))
            if recorded[key]:
                recorded[key] -= 1
            elif row:
                missing.append((row, step))
        for row, step in missing:
            self.log_metrics(row, step)
        if missing:
            rank_zero_info(f"W&B: sent {len(missing)} rows of {metrics_csv} that the earlier attempts did not record")
        return len(missing)

    def _note_best(self, metrics: Mapping[str, Any]) -> dict[str, dict[str, float]]:
        """Keep the best value of each score in the run directory; returns the bests an earlier attempt logged, for
        the run's summary."""
        if self._state is None:
            return {}
        scores = {key: float(metrics[key]) for key in BEST_IS_MAX if key in metrics}
        better = {key: value for key, value in scores.items() if value > self._best.get(key, float("-inf"))}
        self._best.update(better)
        if better or not self._state_written:
            self._save_state()
        return {key: {"max": self._best[key]} for key in scores if key in self._carried}
