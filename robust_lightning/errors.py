"""User-facing errors.

A ``UserError`` means the input (a path, a config value, a checkpoint) is wrong, not the code: the CLI prints
its message alone, without a traceback, and exits with status 2. Under srun or torchrun, where every process of the
job meets the same error in the same config, the job's rank 0 alone prints it (:func:`print_error`).
"""

import os
import sys


class UserError(Exception):
    """Bad input that the user can fix; the message names the problem and what was expected."""


PROG = "robust-lightning"  # how messages name the command, however it was started (``python -m robust_lightning``)


def job_rank() -> int:
    """This process's global rank in a job whose processes all run the same command, read from the environment
    before Lightning sets anything up: torchrun's ``RANK``, else srun's ``SLURM_PROCID`` where the step has several
    tasks (``SLURM_NTASKS``); 0 for a process started alone."""
    rank = os.environ.get("RANK")
    if rank is None and _integer(os.environ.get("SLURM_NTASKS"), 1) > 1:
        rank = os.environ.get("SLURM_PROCID")
    return _integer(rank, 0)


def _integer(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def print_error(message: str, *, every_rank: bool = False) -> None:
    """``robust-lightning: error: MESSAGE`` on standard error, printed by the job's rank 0 only (:func:`job_rank`):
    under srun or torchrun every process parses the same config and meets the same error, and one copy says it (the
    others exit with the same status, silently). ``every_rank``: an error a rank may meet alone, printed by it."""
    if every_rank or job_rank() == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr)
