"""How the processes of a SLURM job take its signals: who ignores them, and who requeues the job
(:func:`requeue_this_job`, which a fit and an evaluation share).

Processes started by srun: SLURM delivers the requeue signal (``--signal=SIGUSR1@90``,
``scancel --signal=USR1``) and the stop signal (SIGTERM: pre-emption, time limit, scancel) to every process of the
job step, forked DataLoader workers included. A forked worker inherits Lightning's handlers and runs them itself:
on SIGUSR1 it saves an hpc_ckpt_N.ckpt from its stale copy of the trainer (which can overwrite the real one, so the
requeued job resumes from an older step) and requeues the job once more; on SIGTERM it would signal and broadcast
to the ranks from its copy. Children forked by a process that called :func:`shield_forked_children` ignore both
instead; the training process handles them alone, and its workers end with it. DataLoader workers need it again
at their start (:func:`ignore_job_signals` as their ``worker_init_fn``): torch's worker loop installs a SIGTERM
handler of its own, which ends the worker unless its parent sent the signal, and the loader then fails the
training process with "DataLoader worker ... is killed by signal: Terminated". ``robust-lightning`` (also as
``python -m robust_lightning``, which needs no console script on the compute nodes) and a sweep's cells call it
first thing.

A loader worker must still end when its own parent sends SIGTERM: that is how a worker left running is ended when
the training process exits (multiprocessing's exit handler terminates every daemonic child, then waits for it). A
worker is left running when an error ends a command in the middle of an epoch: the loader's iterator, which would
tell its workers to stop, is then kept alive by the error's traceback until the process exits. A worker that
ignored every SIGTERM kept the exiting process waiting for ever. So a loader worker blocks SIGTERM and a thread of
its own takes each one: from its parent it ends the worker (status 0, as torch's own handler does); from anyone
else (the scheduler) it is dropped.
"""

import atexit
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import threading

from lightning.pytorch.utilities import rank_zero_info

log = logging.getLogger(__name__)


def ignore_job_signals(worker_id: int | None = None) -> None:
    """Ignore SLURM's requeue and stop signals in this process, a forked child. Given a worker id (as a
    DataLoader's ``worker_init_fn``), the worker still ends on a SIGTERM that its parent sends."""
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # forked from a thread other than the main one: Python cannot set handlers there
        pass
    if worker_id is not None:
        end_on_parent_sigterm()


def end_on_parent_sigterm() -> None:
    """End this process (status 0) when its parent sends it SIGTERM, and drop a SIGTERM from anyone else.

    SIGTERM is blocked in this thread, and so in every thread it starts later; a daemon thread waits for it and
    reads who sent it. Call it before the process starts threads of its own (a forked worker, first thing). Where
    the sender cannot be read (no ``sigwaitinfo``), SIGTERM stays as it was."""
    if not hasattr(signal, "sigwaitinfo"):
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait_for_sigterm, name="end-on-parent-sigterm", daemon=True).start()


def shield_forked_children() -> None:
    os.register_at_fork(after_in_child=ignore_job_signals)
    atexit.register(_end_daemonic_children)


def _end_daemonic_children() -> None:
    """At exit, the loader workers still running (an error left them mid-epoch) are killed before multiprocessing's
    own exit handler sends them SIGTERM and waits for them: a scheduler's SIGTERM still pending in a worker absorbs
    its parent's (two pending SIGTERMs are one), and the exit would wait for the job's SIGKILL."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def requeue_this_job(signum: int, then: str) -> bool:
    """``scontrol requeue`` of this SLURM job (an array job's own task), as Lightning's requeue handler runs it, on
    the requeue signal ``signum``; ``then`` says what the requeued job does. Called by rank zero alone. Returns
    whether SLURM took the requeue; a failure is logged as a warning."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.warning(f"the requeue signal ({signum}) came, but this is no SLURM job to requeue (job id {job!r})")
        return False
    rank_zero_info(f"Handling auto-requeue signal: {signum}: requeueing SLURM job {job}; {then}")
    status: int | str  # the exit status, or why scontrol could not run
    try:
        status = subprocess.call(["scontrol", "requeue", job])
    except OSError as e:
        status = f"{type(e).__name__}: {e}"
    if status != 0:
        log.warning(f"Requeuing SLURM job {job} failed: {status}")
        return False
    rank_zero_info(f"Requeued SLURM job: {job}")
    return True
