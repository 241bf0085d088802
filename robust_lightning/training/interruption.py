"""A fit stopped by a signal ends honestly: promptly, with a checkpoint, a message saying how to resume, and a
non-zero exit status (the command line's; ``robust_lightning.cli``).

Lightning notes SIGTERM but, in one process, stops only at the end of the epoch (hours on ImageNet), and its
``SIGTERMException`` is a ``SystemExit`` without a code: the process exits 0, which schedulers, scripts and sweep
bookkeeping take for a finished run. Here a fit stops at the next step boundary (under DDP every rank at the same
one: the ranks agree at the start of each step), ``last.ckpt`` is written where training went further than the last
checkpoint (one process only: under DDP a save is a collective that ranks stopped at different steps would never
complete), and the resume command is printed. SIGINT (Ctrl-C) ends the same way; Lightning exits 1 after it.
SLURM's requeue (SIGUSR1, then SIGTERM) is Lightning's and keeps working: the requeued job resumes from its
``hpc_ckpt_N.ckpt``.
"""

import logging
import shlex
import signal
import sys
import threading
from functools import partial

import torch
from lightning import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_SIGTERM = 128 + 15  # the shell's status for a process ended by SIGTERM
log = logging.getLogger(__name__)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes a fit: the same arguments with ``--ckpt_path last``."""
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
    return shlex.join(["robust-lightning", *kept, "--ckpt_path", "last"])


def _take_over_sigterm(trainer) -> None:
    """Replace Lightning's SIGTERM handler by one that only notes the signal (and forwards it to the ranks this
    process launched, as Lightning's does). Lightning's also broadcasts from inside the handler, a collective at
    whatever point each rank was interrupted: under DDP, with every rank signalled (SLURM, a process group), the
    ranks then wait in different collectives forever.

    Under DDP the noted signal is acted on only where every rank is, at the start of a training step
    (:func:`_stop_together`, in place of Lightning's broadcast of rank zero's flag there). Lightning also stops a
    rank whose own flag is set at the end of its step: a rank signalled a moment before the others would leave
    alone, and the others would fail in the next step's gradient all-reduce."""
    if threading.current_thread() is not threading.main_thread() or getattr(trainer, "_rl_sigterm_taken", False):
        return
    connector = trainer._signal_connector
    distributed = trainer.world_size > 1
    trainer._rl_sigterm_pending = False
    if distributed:
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = partial(_stop_together, trainer)

    def note_sigterm(signum, frame) -> None:
        log.info(f"[rank {trainer.global_rank}] received SIGTERM: stopping at the next step")
        if not (connector.received_sigterm or trainer._rl_sigterm_pending) and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        if distributed:
            trainer._rl_sigterm_pending = True
        else:
            connector.received_sigterm = True

    signal.signal(signal.SIGTERM, note_sigterm)  # Lightning's teardown restores the handler it found at its start
    # restart the system calls the signal interrupts: a collective's socket read cut short (EINTR) would fail
    # that rank's collective while the others complete theirs
    signal.siginterrupt(signal.SIGTERM, False)
    trainer._rl_sigterm_taken = True


def _stop_together(trainer) -> None:
    """At the start of a training step, where every rank is: stop all of them if any noted SIGTERM (the largest
    flag over the ranks). One small collective per step, as Lightning's broadcast it replaces."""
    flag = torch.tensor([1 if trainer._rl_sigterm_pending else 0], device=trainer.strategy.root_device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item():
        trainer._signal_connector.received_sigterm = True
        raise SIGTERMException()


class Interruption(Callback):
    """Stops a fit at the step boundary after SIGTERM, saves ``last.ckpt`` and says how to resume."""

    # after Lightning registers its signal handlers (Trainer._run), before any batch
    def on_train_start(self, trainer, pl_module) -> None:
        _take_over_sigterm(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        _take_over_sigterm(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        _take_over_sigterm(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        _take_over_sigterm(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        trainer._rl_sigterm_taken = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.received_sigterm and trainer.world_size == 1:  # under DDP _stop_together raises it
            raise SIGTERMException()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, (SIGTERMException, KeyboardInterrupt)) or trainer.state.fn != "fit":
            return
        checkpoint = trainer.checkpoint_callback
        has_last = isinstance(checkpoint, ModelCheckpoint) and checkpoint.save_last
        # Under DDP a save is a collective, and the ranks may stop at different steps (each gets the signal, and
        # Lightning's handler broadcasts it from inside the signal handler): no collective here, the run resumes
        # from its last checkpoint (on SLURM, the requeue's hpc_ckpt_N.ckpt).
        if has_last and checkpoint.dirpath and trainer.world_size == 1:
            if checkpoint._last_global_step_saved != trainer.global_step:  # steps since the last checkpoint
                checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))
        saved = checkpoint.last_model_path if has_last else None
        signal_name = "SIGTERM" if isinstance(exception, SIGTERMException) else "SIGINT (Ctrl-C)"
        where = f"last checkpoint: {saved}" if saved else "no checkpoint yet"
        rank_zero_info(f"\nfit interrupted by {signal_name} at epoch {trainer.current_epoch}, step "
                       f"{trainer.global_step}; {where}\nresume with: {resume_command(sys.argv[1:])}")
