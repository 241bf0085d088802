"""``srun python -m robust_lightning.scale.srun fit --config ...``: robust-lightning for processes started by srun
(``robust-lightning`` itself shields its forked children the same way; this entry point needs no console script).

SLURM delivers the requeue signal (``--signal=SIGUSR1@90``, ``scancel --signal=USR1``) to every process of the
job step, forked DataLoader workers included. A forked worker inherits Lightning's SIGUSR1 handler and runs it
itself: it saves an hpc_ckpt_N.ckpt from its stale copy of the trainer (which can overwrite the real one, so
the requeued job resumes from an older step) and requeues the job once more. Children forked by this process
ignore SIGUSR1 instead; the training process handles it alone.
"""

import os
import signal
import sys


def _ignore_sigusr1() -> None:
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    except ValueError:  # forked from a thread other than the main one: Python cannot set handlers there
        pass


def shield_forked_children() -> None:
    os.register_at_fork(after_in_child=_ignore_sigusr1)


def main(argv: list[str] | None = None) -> int:
    from robust_lightning.cli import main as cli_main  # it shields the forked children too

    argv = sys.argv[1:] if argv is None else argv
    sys.argv = ["robust-lightning", *argv]  # what results.json records as the command
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
