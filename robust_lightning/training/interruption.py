"""A fit stopped by a signal ends honestly: promptly, with a checkpoint, a message saying what happens next, and a
non-zero exit status (the command line's; ``robust_lightning.cli``).

Lightning notes SIGTERM but, in one process, stops only at the end of the epoch (hours on ImageNet), and its
``SIGTERMException`` is a ``SystemExit`` without a code: the process exits 0, which schedulers, scripts and sweep
bookkeeping take for a finished run. Here a fit stops at the next step boundary (under DDP every rank at the same
one: the ranks agree at the end of each step) and writes a checkpoint of that step there, where training went
further than the last checkpoint: a collective save (every rank at that boundary), in one process and under DDP
alike. The message then says the one command that continues the fit. SIGINT (Ctrl-C) ends the same way; Lightning
exits 1 after it; under DDP it saves nothing (each rank stops wherever it was: no collective).

SLURM's requeue signal (SIGUSR1 with ``#SBATCH --signal``) is acted on at the end of the training step in progress
too. Lightning's own handler runs inside the signal handler: a checkpoint of half a step (the resumed run then
trained that batch twice) and, under DDP, a collective wherever each rank was. Here the step is finished, its
``hpc_ckpt_N.ckpt`` written (Lightning resumes a requeued job from it), the W&B run finished, the job requeued, and
the fit stops: SLURM ends the requeued job at once (SIGTERM), so training on would only add steps that a SIGTERM
loses in W&B. The message says that SLURM resumes the job, with nothing for the user to run.
"""

import logging
import signal
import sys
import threading
from typing import Any

import torch
from lightning import Callback
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from robust_lightning.errors import user_command
from robust_lightning.job_signals import requeue_this_job
from robust_lightning.loggers import end_wandb_before_job_signal

EXIT_SIGTERM = 128 + 15  # the shell's status for a process ended by SIGTERM
log = logging.getLogger(__name__)


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


def _take_over_signals(trainer) -> None:
    """Replace Lightning's SIGTERM handler (and, in a fit on SLURM, its requeue handler) by ones that only note the
    signal; :func:`_act_on_signals` acts on them at the end of a training step. SIGTERM is also forwarded to the
    ranks this process launched, as Lightning's handler does. Lightning's SIGTERM handler also broadcasts from
    inside the handler, a collective at whatever point each rank was interrupted: under DDP, with every rank
    signalled (SLURM, a process group), the ranks then wait in different collectives forever.

    Under DDP a noted signal is acted on only where every rank is, at the end of a training step (the largest flag
    over the ranks). Lightning would stop a rank whose own SIGTERM flag is set: a rank signalled a moment before the
    others would leave alone, and the others would fail in the next step's gradient all-reduce. In one process
    SIGTERM also ends a validation loop in progress (Lightning checks the flag between its batches)."""
    if threading.current_thread() is not threading.main_thread() or getattr(trainer, "_rl_signals_taken", False):
        return
    connector = trainer._signal_connector
    distributed = trainer.world_size > 1
    trainer._rl_sigterm_pending = trainer._rl_requeue_pending = False
    trainer._rl_requeued = None  # [hpc_ckpt_N.ckpt, its step] once this process requeued the job
    if distributed:  # its broadcast of rank zero's flag at the start of a step; _act_on_signals decides instead
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None

    def note_sigterm(signum, frame) -> None:
        log.info(f"[rank {trainer.global_rank}] received SIGTERM: stopping at the next step")
        if not (connector.received_sigterm or trainer._rl_sigterm_pending) and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        if distributed:
            trainer._rl_sigterm_pending = True
        else:
            connector.received_sigterm = True

    def note_requeue(signum, frame) -> None:
        log.info(f"[rank {trainer.global_rank}] received the requeue signal: checkpoint and requeue after this step")
        trainer._rl_requeue_pending = True

    # restart the system calls a signal interrupts: a collective's socket read cut short (EINTR) would fail that
    # rank's collective while the others complete theirs
    signal.signal(signal.SIGTERM, note_sigterm)  # Lightning's teardown restores the handlers it found at its start
    signal.siginterrupt(signal.SIGTERM, False)
    requeue = _requeue_signal(trainer)
    if requeue is not None and trainer.state.fn == "fit":
        signal.signal(requeue, note_requeue)
        signal.siginterrupt(requeue, False)
    trainer._rl_signals_taken = True


def _requeue_signal(trainer):
    """The signal Lightning requeues a SLURM job on, or None where it does not (not SLURM, auto_requeue off)."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def _requeue(trainer) -> None:
    """SLURM's requeue at the end of a training step, where every rank is: the loggers flushed, hpc_ckpt_N.ckpt of
    this step (a collective), then, on rank zero, the W&B run finished and ``scontrol requeue``. The W&B run is
    finished first because the SIGTERM with which SLURM ends the requeued job also reaches W&B's wandb-core
    process, which dies without writing what it holds (wandb/wandb issue 9963); the fit stops here, so nothing
    logs after it. Where SLURM took the requeue, ``trainer._rl_requeued`` names the checkpoint it resumes from;
    where it did not, last.ckpt is written too, for the resume the message then advises."""
    for logger in trainer.loggers:  # as Lightning's requeue handler: every row logged so far on disk
        logger.finalize("finished")
    path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
    trainer.save_checkpoint(path)
    requeued = False
    if trainer.is_global_zero:
        end_wandb_before_job_signal(EXIT_SIGTERM)  # the exit status this attempt ends with
        requeued = requeue_this_job(_requeue_signal(trainer), f"the requeued job resumes from {path}")
    if trainer.strategy.broadcast(requeued, src=0):
        trainer._rl_requeued = [path, trainer.global_step]
    else:
        _save_at_stop(trainer)


def _save_at_stop(trainer) -> None:
    """A checkpoint of the step the fit stops at (last.ckpt), where training went further than the last checkpoint.
    Every rank calls it at the same point: under DDP a save is a collective (every rank dumps its state, rank zero
    writes, a barrier; ModelCheckpoint's also broadcasts whether the file exists)."""
    if getattr(trainer, "_rl_requeued", None) is not None:  # SLURM resumes the job from its hpc checkpoint
        return
    checkpoint = trainer.checkpoint_callback
    if not (isinstance(checkpoint, ModelCheckpoint) and checkpoint.save_last and checkpoint.dirpath):
        return
    if checkpoint._last_global_step_saved == trainer.global_step:  # saved at this step already
        return
    save_last, checkpoint.save_last = checkpoint.save_last, True  # "link" would point it at an older step's file
    try:
        checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))
    finally:
        checkpoint.save_last = save_last


def _act_on_signals(trainer) -> None:
    """At the end of a training step: if the requeue signal came, requeue the job; if SIGTERM came, save this step.
    Either way the fit stops here. Under DDP every rank does so at the same step: one small collective per step, as
    Lightning's broadcast it replaces."""
    requeue, stop = trainer._rl_requeue_pending, trainer.received_sigterm
    if trainer.world_size > 1:
        flags = torch.tensor([int(requeue), int(trainer._rl_sigterm_pending)], device=trainer.strategy.root_device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        requeue, stop = flags.tolist()
    if not (requeue or stop):
        return
    # this step is checkpointed and will not be trained again: its row, which Lightning logs after the step's end
    # hooks, is logged now
    trainer._logger_connector.update_train_step_metrics()
    if requeue:
        trainer._rl_requeue_pending = False
        _requeue(trainer)
    else:
        _save_at_stop(trainer)
    trainer._signal_connector.received_sigterm = True
    raise SIGTERMException()


class Interruption(Callback):
    """Stops a fit at the step boundary after SIGTERM, saves that step and says what happens next."""

    # after Lightning registers its signal handlers (Trainer._run), before any batch
    def on_train_start(self, trainer, pl_module) -> None:
        _take_over_signals(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        _take_over_signals(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        _take_over_signals(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        _take_over_signals(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        trainer._rl_signals_taken = False

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        _act_on_signals(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, (SIGTERMException, KeyboardInterrupt)) or trainer.state.fn != "fit":
            return
        # Stopped at a step boundary by SIGTERM, the fit saved there (_act_on_signals). In one process a stop
        # elsewhere (SIGTERM in validation, Ctrl-C) saves here; under DDP Ctrl-C stops each rank wherever it was: no
        # collective, the run resumes from its last checkpoint.
        if trainer.world_size == 1:
            _save_at_stop(trainer)
        requeued = getattr(trainer, "_rl_requeued", None)
        if requeued is not None:  # the job is requeued whatever this process does now
            path, step = requeued
            exception.requeued_checkpoint = path  # type: ignore[union-attr]  # for the command line's last word
            rank_zero_info(
                f"\nfit stopped at epoch {trainer.current_epoch}, step {step} for SLURM's requeue of the job\n"
                f"SLURM restarts the job, which resumes from {path}: nothing to run (a resume of your own would start "
                "a second copy of the run)"
            )
            return
        signal_name = "SIGTERM" if isinstance(exception, SIGTERMException) else "SIGINT (Ctrl-C)"
        stopped = f"\nfit interrupted by {signal_name} at epoch {trainer.current_epoch}, step {trainer.global_step}"
        checkpoint = trainer.checkpoint_callback
        saved = checkpoint.last_model_path if isinstance(checkpoint, ModelCheckpoint) and checkpoint.save_last else None
        if saved and checkpoint._last_global_step_saved == trainer.global_step:
            where = f"checkpoint of this step: {saved}"
        else:
            where = f"last checkpoint: {saved}" if saved else "no checkpoint yet"
        rank_zero_info(f"{stopped}; {where}\nresume with: {resume_command(sys.argv[1:])}")
