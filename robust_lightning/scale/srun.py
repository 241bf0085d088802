"""Processes started by srun: SLURM delivers the requeue signal (``--signal=SIGUSR1@90``,
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
"""

import os
import signal


def ignore_job_signals(*_) -> None:
    """Ignore SLURM's requeue and stop signals in this process (a forked child; ``*_``: a worker id)."""
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # forked from a thread other than the main one: Python cannot set handlers there
        pass


def shield_forked_children() -> None:
    os.register_at_fork(after_in_child=ignore_job_signals)
