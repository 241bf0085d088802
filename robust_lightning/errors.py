"""User-facing errors, and the commands that messages tell the user to run (:func:`user_command`).

A ``UserError`` means the input (a path, a config value, a checkpoint) is wrong, not the code: the CLI prints
its message alone, without a traceback, and exits with status 2. Under srun or torchrun, where every process of the
job meets the same error in the same config, the job's rank 0 alone prints it (:func:`print_error`). An error met
after the Trainer is built may be one rank's own; :func:`print_rank_error` still prints it once per job.
"""

import os
import shlex
import shutil
import sys
import time
from pathlib import Path


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


RANK_ZERO_WAIT = 5.0  # seconds another rank waits for rank 0's copy of an error before printing its own


def print_rank_error(message: str, rank: int, world_size: int, shared: Path | None) -> None:
    """An error met after the Trainer was built, when it may be one rank's own (a file that rank reads), printed
    once per job all the same. Each rank files its message in ``shared``, a folder every rank of the job sees (the
    run root). Rank 0 prints its own. Another rank prints its own, naming its rank, unless rank 0 filed the same
    message within ``RANK_ZERO_WAIT`` seconds. So an error every rank meets is printed once, and one rank's error
    is not lost. There is no collective: a rank that died or hangs makes the others wait that long at most.
    Without a shared folder (a single process, or one that cannot be written) each rank prints its own."""
    folder = _job_error_folder(shared) if world_size > 1 else None
    if folder is None:
        print_error(message, every_rank=True)
        return
    own = folder / f"rank{rank}.txt"
    partial = folder / f".rank{rank}.partial"
    try:
        partial.write_text(message)
        partial.replace(own)
    except OSError:
        print_error(message, every_rank=True)
        return
    if rank == 0:
        print_error(message, every_rank=True)
        return
    first = folder / "rank0.txt"
    deadline = time.monotonic() + RANK_ZERO_WAIT
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        same = first.read_text() == message
    except OSError:
        same = False
    if not same:
        print_error(f"(rank {rank}) {message}", every_rank=True)
    _done(folder, own, rank, world_size)


def _done(folder: Path, own: Path, rank: int, world_size: int) -> None:
    """Rank ``rank`` (not 0) has decided; the last of the ranks to decide removes the job's folder."""
    try:
        own.replace(folder / f"done{rank}")
        if len(list(folder.glob("done*"))) == world_size - 1:
            shutil.rmtree(folder, ignore_errors=True)
            folder.parent.rmdir()  # .errors, where no other job's folder is left
    except OSError:
        pass


def _job_error_folder(shared: Path | None) -> Path | None:
    """``shared/.errors/<job>``: one folder per job and attempt, named from what the launcher gives every rank
    alike (torchrun's run id and restart count, SLURM's job, step and restart count, else the rendezvous address).
    The folders that earlier jobs left (untouched for an hour) are removed. None where no such name or folder is to
    be had."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID"):
        job = f"torchrun-{env['TORCHELASTIC_RUN_ID']}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    elif env.get("SLURM_JOB_ID"):
        job = f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '')}-{env.get('SLURM_RESTART_COUNT', '0')}"
    elif env.get("MASTER_PORT"):
        job = f"ddp-{env.get('MASTER_ADDR', '')}-{env['MASTER_PORT']}"
    else:
        return None
    if shared is None:
        return None
    root = Path(shared) / ".errors"
    folder = root / "".join(c if c.isalnum() or c in "-._" else "_" for c in job)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for earlier in root.iterdir():
            if earlier != folder and time.time() - earlier.stat().st_mtime > 3600:  # not a job running beside
                shutil.rmtree(earlier, ignore_errors=True)
    except OSError:
        return None
    return folder


def user_command(*args: str) -> str:
    """``robust-lightning ARGS`` as it runs in the shell this process was started from: every command the project
    prints for the user to run (the resume advice of an interrupted fit, a repair, a report) is made here.

    ``robust-lightning`` where that name on PATH is this program. Otherwise the program as it was started, since
    the bare name would not run (the environment not activated: ``.venv/bin/`` is not on PATH): the console script
    by the path it was started with (``.venv/bin/robust-lightning``), or this interpreter with ``-m
    robust_lightning``. A process not started as the program (the Python API, a sweep cell, a test calling
    ``main``) gets the bare name: no shell of the user's started it."""
    return shlex.join([*_program(), *args])


def _program() -> list[str]:
    started = sys.argv[0] if sys.argv else ""
    on_path = shutil.which(PROG)
    if os.path.basename(started) == PROG and os.path.isfile(started):  # the console script
        try:
            if on_path and os.path.samefile(on_path, started):
                return [PROG]
        except OSError:
            pass
        return [started if os.sep in started else os.path.abspath(started)]
    package = Path(__file__).resolve().parent
    if started.endswith(".py") and Path(started).resolve().parent == package:  # python -m robust_lightning(.cli)
        # the name on PATH runs this program where it is the console script of this interpreter's environment
        if on_path and os.path.realpath(os.path.dirname(on_path)) == os.path.realpath(os.path.dirname(sys.executable)):
            return [PROG]
        return [sys.executable, "-m", "robust_lightning"]
    return [PROG]
