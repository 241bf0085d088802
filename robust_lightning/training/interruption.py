"""A command stopped by a signal ends honestly: within a batch, with a checkpoint of the last trained step, a
message saying what happens next, and the exit status 143 (130 for Ctrl-C; the command line's,
``robust_lightning.cli``).

SIGTERM (pre-emption, a time limit, ``scancel``), SLURM's requeue signal (``#SBATCH --signal``) and the first
Ctrl-C are only noted when they come (``robust_lightning.job_signals``). Lightning's own handlers act inside the
handler: its SIGTERM handler broadcasts, a collective wherever each rank was, and its requeue handler saves a
checkpoint of half a step. Here the command acts at its next batch boundary, wherever that is:

- in a training step, at the step's end (under DDP the ranks agree there at every step: one small all-reduce, as
  Lightning's broadcast it replaces). A step that a validation or the epoch's end follows stops at the start of
  that validation, or of the next epoch, instead: a checkpoint written between a step and its validation would
  resume past that validation, and Lightning would never run it;
- in a validation (its selection attack included), a test or a prediction, at the next batch, and in an
  evaluation's own loop (``robust_lightning.evaluation.base``), at the next batch. An evaluation that keeps its
  outcomes per batch (AutoAttack) keeps those of every finished batch;
- in a checkpoint's save, at the next boundary after it.

A fit then writes a checkpoint of the last trained step and stops. A stop inside a validation saves the state of
that validation's start: the resumed fit runs the whole validation again and publishes only its complete
results. The row of a training step the fit stops at is in metrics.csv, and on disk, before its checkpoint is
written; W&B gets it after the checkpoint, and a W&B that died with the job (SLURM signals every process of the
job, W&B's service included) costs a warning, never the step (``robust_lightning.loggers``). On the requeue
signal the checkpoint is ``hpc_ckpt_N.ckpt`` in ``trainer.default_root_dir``, replacing the previous requeue's,
the W&B run is finished and rank zero asks SLURM to requeue the job; on SIGTERM it is last.ckpt. Either way the
message says what happens next. Ctrl-C stops as SIGTERM does, with last.ckpt. A second Ctrl-C ends the command
at once, as Lightning ends it, and writes no checkpoint of where it landed.
"""

import copy
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning import Callback
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT

from robust_lightning.errors import user_command
from robust_lightning.job_signals import (
    EXIT_SIGTERM,
    JobSignals,
    JobStopped,
    agree_to_stop,
    requeue_this_job,
    stop_requested,
)
from robust_lightning.loggers import end_wandb_before_job_signal, hold_wandb_rows, send_held_wandb_rows
from robust_lightning.training.checkpoint_io import validation_or_epoch_end_follows
from robust_lightning.training.random_state import RandomStates, random_states

__all__ = ["EXIT_SIGTERM", "Interruption", "resume_command"]

log = logging.getLogger(__name__)
HPC_CHECKPOINT = "hpc_ckpt_"  # what Lightning looks for in a file's name (_CheckpointConnector._hpc_resume_path)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes a fit: the same arguments with ``--ckpt_path last`` (:func:`user_command`)."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--ckpt_path":
            skip = True
            continue
        if not token.startswith("--ckpt_path="):
            kept.append(token)
    return user_command(*kept, "--ckpt_path", "last")


def requeue_signal(trainer: pl.Trainer) -> int | None:
    """The signal on which SLURM asks for a requeue (``#SBATCH --signal``); None where Lightning would not requeue
    (not SLURM, or auto-requeue off)."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def _at_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch that just ended is the last of the validation, test or prediction in progress."""
    if trainer.predicting:  # the prediction loop sets is_last_batch on a progress that does not declare it
        last: bool = trainer.predict_loop.batch_progress.is_last_batch  # type: ignore[attr-defined]
        return last
    return trainer._evaluation_loop.batch_progress.is_last_batch


def _epoch_loop_as_started(fit_loop: dict[str, Any]) -> None:
    """The fit loop's saved state at an epoch's start, with the epoch loop's counters of this epoch at zero, as its
    run resets them (``reset_on_run``). In on_train_epoch_start they still count the previous epoch's batches, and
    a fit resumed from them would take this epoch's batches as done and skip them."""
    for key in ("epoch_loop.batch_progress", "epoch_loop.scheduler_progress"):
        progress = fit_loop[key]
        progress["current"] = dict.fromkeys(progress["current"], 0)
        if "is_last_batch" in progress:
            progress["is_last_batch"] = False
    optimizer = fit_loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    for part in optimizer.values():
        part["current"] = dict.fromkeys(part["current"], 0)
    validation = fit_loop["epoch_loop.val_loop.batch_progress"]
    validation["total"] = dict.fromkeys(validation["total"], 0)  # counts the validations of one epoch


def _command(trainer: pl.Trainer) -> str:
    """The running command: fit, validate, test or predict."""
    fn = trainer.state.fn
    assert fn is not None  # set by each command before its first hook
    return fn.value


class Interruption(Callback):
    """Stops a command at the batch boundary after SIGTERM or SLURM's requeue signal, saves a fit's last trained
    step and says what happens next (module docstring)."""

    def __init__(self) -> None:
        self._deferred: JobStopped | None = None  # a stop agreed at a step end, acted on at the next boundary
        # at the start of a validation inside a fit: its progress (Lightning's counters) and the random states,
        # which a stop inside it saves, so that the resumed fit runs it again from its start
        self._validation_start: tuple[dict[str, Any], RandomStates] | None = None
        self._saving_validation_start = False
        self._saving_epoch_start = False
        self._gives_back = True  # the signals, at teardown (setup)

    # ------------------------------------------------------------------------------------------ the signals
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        def pass_on(signum: int) -> None:  # to the ranks Lightning's launcher started, as its own handler does
            if trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)

        # The command line starts its commands earlier (JobSignals.start_slurm_command) and gives the handlers back
        # once the command has ended, robust_lightning.evaluate once its test has; a Trainer of the caller's here.
        self._gives_back = not JobSignals.started
        if self._gives_back:
            JobSignals.start_command()
        self._deferred, self._validation_start = None, None
        requeue = requeue_signal(trainer)
        if requeue != signal.SIGUSR1:
            JobSignals.not_the_requeue_signal(signal.SIGUSR1)
        JobSignals.take(requeue, pass_on)
        if requeue is not None:
            rank_zero_info(
                f"SLURM's requeue signal ({signal.Signals(requeue).name}) and SIGTERM stop this "
                f"{_command(trainer)} at its next batch boundary"
            )
        # Lightning registers handlers of its own after the setup hooks (Trainer._run), which would act inside the
        # handler: its SIGTERM handler broadcasts (under DDP a collective wherever each rank was) and its requeue
        # handler saves half a step. This command's handlers take their place at once. Lightning's registration
        # stays: it records every handler of the process, which its teardown restores (a DataLoader's SIGCHLD
        # handler among them, which would otherwise fail the exit of a command whose loader workers are killed).
        # Lightning's teardown, before on_fit_end, puts this command's handlers back with signal.signal, which
        # drops their restart of interrupted system calls: the end-of-fit evaluations' collectives need it.
        connector = trainer._signal_connector
        register, teardown = connector.register_signal_handlers, connector.teardown

        def register_then_take() -> None:
            register()
            JobSignals.take(requeue, pass_on)

        def teardown_then_take() -> None:
            teardown()
            JobSignals.take(requeue, pass_on)

        connector.register_signal_handlers = register_then_take  # type: ignore[method-assign]  # above
        connector.teardown = teardown_then_take  # type: ignore[method-assign]  # above

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress.state_dict()
            self._validation_start = (copy.deepcopy(progress), random_states())
            self._act_on_deferred_stop("validation")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._gives_back:
            JobSignals.give_back()

    # ---------------------------------------------------------------------------------------------- training
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: object, batch_idx: int
    ) -> None:
        loop = trainer.fit_loop.epoch_loop
        if loop._should_accumulate():  # the step is not over: its gradient is in part on the device only
            return
        stop = agree_to_stop("step")
        if stop is None:
            return
        if validation_or_epoch_end_follows(trainer):
            # Lightning resumes a checkpoint of this point past them, so the stop waits for the start of the
            # validation or of the next epoch (or the fit's end).
            self._deferred = stop
            return
        raise stop

    def _act_on_deferred_stop(self, where: str) -> None:
        stop, self._deferred = self._deferred, None
        if stop is not None:
            stop.where = where
            raise stop

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._act_on_deferred_stop("epoch start")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the last epoch's end is over; the end-of-fit evaluations have not started
        self._act_on_deferred_stop("training end")

    # ----------------------------------------------------------------------------- validation, test, predict
    def _stop_at_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, last: bool) -> None:
        """At a batch boundary of a validation, test or prediction: stop where a signal was noted (here or on
        another rank), and at the last batch agree with the other ranks whether to."""
        if trainer.sanity_checking:
            where = "sanity check"
        elif trainer.predicting:
            where = "prediction"
        else:
            where = "validation" if trainer.validating else "test"
        if last or stop_requested():
            stop = agree_to_stop(where)
            if stop is not None:
                raise stop

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._stop_at_batch(trainer, pl_module, last=False)

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._stop_at_batch(trainer, pl_module, last=False)

    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._stop_at_batch(trainer, pl_module, last=False)

    # The agreement at the last batch comes after the batch's work, that of the config's callbacks included (they
    # come first in the trainer's list): an evaluation that cut its last batch short on a signal never publishes.
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._stop_at_batch(trainer, pl_module, last=_at_last_batch(trainer))

    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._stop_at_batch(trainer, pl_module, last=_at_last_batch(trainer))

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._stop_at_batch(trainer, pl_module, last=_at_last_batch(trainer))

    # ------------------------------------------------------------------------------------------- the stop
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A stop inside a validation saves the state of that validation's start: its progress as Lightning's
        counters have it when a restart is to run a validation from its first batch, and the random states drawn
        from there (the module keeps the states it finds here). A stop at an epoch's start saves the epoch loop's
        counters as that epoch's run starts them."""
        if self._saving_epoch_start:
            _epoch_loop_as_started(checkpoint["loops"]["fit_loop"])
        if not self._saving_validation_start or self._validation_start is None:
            return
        progress, states = copy.deepcopy(self._validation_start)
        done = progress["total"]["completed"]  # batches of the epoch's earlier validations
        progress["total"].update(ready=done + 1, started=done + 1, processed=done, completed=done)
        progress["current"].update(ready=1, started=1, processed=0, completed=0)
        progress["is_last_batch"] = False
        checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"] = progress
        checkpoint["random_states"] = states

    # The signals are given back when the command ends (the command line, robust_lightning.evaluate): a signal
    # that comes while a stopped fit saves its checkpoint is noted, not fatal.
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, JobStopped):
            if trainer.state.fn == "fit" and exception.where != "sanity check":
                self._save_stop(trainer, exception)
            if exception.requeue and trainer.is_global_zero:
                end_wandb_before_job_signal(EXIT_SIGTERM)  # before SLURM's SIGTERM reaches W&B's service
                then = "the requeued job resumes " + ("from " + exception.checkpoint if exception.checkpoint else "it")
                exception.requeued = requeue_this_job(requeue_signal(trainer) or 0, then)
            self._say_what_happens_next(trainer, exception)
        elif isinstance(exception, KeyboardInterrupt) and trainer.state.fn == "fit":
            # A second Ctrl-C (the first stops at the next batch boundary) stops the fit wherever it landed. No
            # checkpoint is written there: one written inside a training step resumed another run than the one
            # left alone (the step counted twice in the logs, other weights).
            self._say_what_happens_next(trainer, exception)

    def _save_stop(self, trainer: pl.Trainer, stop: JobStopped) -> None:
        """The checkpoint a stopped fit resumes from, of its last trained step; every rank calls it (a save is a
        collective). A stop at a step's end logs that step's row first, to metrics.csv at once and to W&B after
        the save."""
        held = hold_wandb_rows(trainer.loggers)
        try:
            if stop.where == "step":  # Lightning logs a step's row after the hooks of its end, where it stopped
                trainer._logger_connector.update_train_step_metrics()
            self._saving_validation_start = stop.where == "validation"
            self._saving_epoch_start = stop.where == "epoch start"
            try:
                stop.checkpoint = self._save_hpc(trainer) if stop.requeue else self._save_last(trainer)
            finally:
                self._saving_validation_start = self._saving_epoch_start = False
        finally:
            send_held_wandb_rows(held)

    def _save_last(self, trainer: pl.Trainer) -> str | None:
        """last.ckpt of this point, through the checkpoint callback (which then knows it); an hpc checkpoint where
        the run keeps no last.ckpt."""
        checkpoint = trainer.checkpoint_callback
        if not (isinstance(checkpoint, ModelCheckpoint) and checkpoint.save_last and checkpoint.dirpath):
            return self._save_hpc(trainer)
        save_last, checkpoint.save_last = checkpoint.save_last, True  # "link" would point it at an older step's file
        try:
            checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))
        finally:
            checkpoint.save_last = save_last
        return checkpoint.last_model_path

    def _save_hpc(self, trainer: pl.Trainer) -> str:
        """``hpc_ckpt_N.ckpt`` in ``trainer.default_root_dir`` (Lightning's name for a requeue's checkpoint),
        replacing the earlier ones: a requeue a day would otherwise keep a copy of the run for each."""
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            for older in Path(path).parent.glob(f"{HPC_CHECKPOINT}*.ckpt"):
                if older.name != Path(path).name:
                    older.unlink(missing_ok=True)
        return str(path)

    def _say_what_happens_next(self, trainer: pl.Trainer, exception: BaseException) -> None:
        stopped = f"at epoch {trainer.current_epoch}, step {trainer.global_step}"
        if isinstance(exception, JobStopped) and exception.requeued:
            rank_zero_info(
                f"\n{_command(trainer)} stopped {stopped} for SLURM's requeue of the job\nSLURM restarts the job, "
                f"which resumes {'from ' + exception.checkpoint if exception.checkpoint else 'it'}: nothing to run (a "
                "resume of your own would start a second copy of the run)"
            )
            return
        if trainer.state.fn != "fit":
            return  # the command line's last word says how to run it again
        stop = exception if isinstance(exception, JobStopped) else None
        signal_name = "SIGTERM" if stop is not None and not stop.ctrl_c else "SIGINT (Ctrl-C)"
        if stop is not None and stop.requeue and not stop.requeued:
            signal_name = "SLURM's requeue signal (the requeue failed)"
        saved = stop.checkpoint if stop is not None else self._last_saved(trainer)
        where = f"checkpoint of this step: {saved}" if saved else "no checkpoint of this step"
        latest = trainer.checkpoint_callback
        if not saved and isinstance(latest, ModelCheckpoint) and latest.last_model_path:
            where += f" (the latest: {latest.last_model_path})"
        rank_zero_info(
            f"\nfit interrupted by {signal_name} {stopped}; {where}\nresume with: {resume_command(sys.argv[1:])}"
        )

    @staticmethod
    def _last_saved(trainer: pl.Trainer) -> str | None:
        checkpoint = trainer.checkpoint_callback
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint._last_global_step_saved == trainer.global_step:
            return checkpoint.last_model_path or None
        return None
