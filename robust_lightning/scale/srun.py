"""Processes started by srun: SLURM delivers the requeue signal (``--signal=SIGUSR1@90``,
``scancel --signal=USR1``) to every process of the job step, forked DataLoader workers included. A forked worker
inherits Lightning's SIGUSR1 handler and runs it itself: it saves an hpc_ckpt_N.ckpt from its stale copy of the
trainer (which can overwrite the real one, so the requeued job resumes from an older step) and requeues the job
once more. Children forked by a process that called :func:`shield_forked_children` ignore SIGUSR1 instead; the
training process handles it alone. ``robust-lightning`` (also as ``python -m robust_lightning``, which needs no
console script on the compute nodes) and a sweep's cells call it first thing.
"""

import os
import signal


def _ignore_sigusr1() -> None:
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    except ValueError:  # forked from a thread other than the main one: Python cannot set handlers there
        pass


def shield_forked_children() -> None:
    os.register_at_fork(after_in_child=_ignore_sigusr1)
