"""How the ranks of a job end: one error per job and nothing after it, and after a stop by SIGTERM every rank at
once.

When one rank of a DDP job fails, the others are usually waiting for it in a collective, such as a gradient
all-reduce or a barrier. Over gloo each of them then fails in turn once the failed rank's process is gone, each
with a traceback of its own ("Connection closed by peer"). Over NCCL they may wait until the collective's time-out,
30 minutes by default. Here the failed rank tells the others through the process group's key-value store, which
needs no collective. While its Trainer runs, each rank keeps a watchdog thread (:class:`RankFailureWatch`). On
hearing of another rank's failure, the watchdog gives this rank a short grace, in which a rank that has failed on
its own still reports its own error. Then it ends this process with exit status 1, whatever the process was
waiting for. The lowest stopped rank prints one line saying why, and the others print nothing. A rank that meets an
exception because another rank failed ends the same way, without a traceback (:func:`stopped_by_other_rank`).

A failed rank tells the others at its exit, after its error is printed (:func:`failed_here`), so that their line
comes after its message. It then waits until the others know of the failure.

Under srun and Lightning's launcher rank 0 holds the store (torchrun's agent holds its own), and a rank that asks
a store that is gone gets a warning of torch's on its output. So rank 0 leaves the store last: before it ends,
whether normally, by another rank's failure or by a stop, it waits until every other rank has said that it asks
the store nothing more (:meth:`_Job.leave_store`). A failed rank 0 waits only until the others know, and they then
ask the store nothing more. Under Lightning's own launcher a node's rank 0 is also the parent of its other ranks.
It kills them all, with a line about it, once one of them ends with a non-zero status (``_ChildProcessObserver``,
lightning/fabric/strategies/launchers/subprocess_script.py). So there a rank ending with a non-zero status ends
after its parent.

A stop by SIGTERM or by SLURM's requeue ends every rank with exit status 143, which is non-zero. Under srun's
``--kill-on-bad-exit``, the first rank to exit makes SLURM send the others SIGTERM, then SIGKILL after its
``KillWait`` (SLURM's src/slurmd/slurmstepd/req.c, ``SIG_TERM_KILL``). After the collective checkpoint, rank 0
still writes ``results.json`` and ends the W&B run. So the ranks leave together (:func:`leave_together`): each
waits at the end of the command until every rank has got there. Rank 0 holds the store and leaves it last, so the
first other rank to exit still brings srun's SIGTERM to the ranks that wait or are ending their process. They
ignore it: a command line's process ignores SIGTERM once its command has stopped
(:func:`robust_lightning.job_signals.ignored_until_exit`).
"""

import atexit
import contextlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer

from robust_lightning.errors import PROG

FAILED = "robust-lightning/failed"  # the rank whose error was reported first
KNOWN = "robust-lightning/known"  # how many ranks know that the job is failing
LEAVING = "robust-lightning/leaving"  # how many ranks have got to the end of a stop by SIGTERM
DONE = "robust-lightning/done"  # how many ranks other than 0 ask the store nothing more
EXIT_STOPPED = 1  # the exit status of a rank stopped by another rank's failure

POLL = 0.2  # seconds between two looks at the store
GRACE = 2.0  # seconds that a rank hearing of a failure waits before it stops (it may be failing on its own)
LINGER = 10.0  # seconds at most that a rank ending by a failure waits for the others
LEAVE_WAIT = 60.0  # seconds at most that a rank waits for the others at the end of a run or of a stop by SIGTERM


class _Job:
    """This process's rank in a job of several, the job's store, and the watchdog's state."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, parent_is_rank: bool):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        # Under Lightning's own launcher, a rank other than its node's rank 0 is that rank's child.
        self.parent = os.getppid() if parent_is_rank else None
        # Held while the watchdog ends this process, and by the main thread to keep the watchdog from doing so.
        self.lock = threading.Lock()
        self.armed = True  # whether the watchdog may still end this process
        self.known: int | None = None  # the failed rank, once this rank knows of it
        self.failed = False  # whether this rank failed (and tells the others at its exit)
        self.left_store = False
        self.stop = threading.Event()  # the watchdog stops
        self.watchdog: threading.Thread | None = None

    def failed_rank(self) -> int | None:
        """The rank whose failure was reported first, or None. Raises when the store cannot be reached."""
        if not self.store.check([FAILED]):
            return None
        return int(self.store.get(FAILED))

    def know(self, rank: int) -> None:
        """Note that ``rank`` failed, and count this rank among those that know (once)."""
        if self.known is None:
            self.known = rank
            with contextlib.suppress(Exception):  # the store is gone with rank 0: nobody waits for the count
                self.store.add(KNOWN, 1)

    def watch(self) -> None:
        if self.watchdog is None and self.armed:
            self.stop.clear()
            self.watchdog = threading.Thread(target=_watch, args=(self,), name="rank-failure-watch", daemon=True)
            self.watchdog.start()

    def stop_watching(self) -> None:
        """Stop the watchdog, which then asks the store nothing more; waits while it is ending this process."""
        self.stop.set()
        with self.lock:
            self.armed = False
        if self.watchdog is not None and self.watchdog is not threading.current_thread():
            self.watchdog.join()
        self.watchdog = None

    def wait(self, done: Callable[[], bool], seconds: float) -> None:
        """Wait until ``done()``, at most ``seconds``; a store that is gone ends the wait."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(Exception):
            while not done() and time.monotonic() < deadline:
                time.sleep(POLL / 2)

    def count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def leave_store(self, seconds: float, until: Callable[[], bool] = lambda: False, status: int = 1) -> None:
        """This rank asks the store nothing more. A rank other than 0 says so; rank 0, which holds the store, waits
        until every other rank has said so, at most ``seconds`` or until ``until()``. Where rank 0 is the failed
        rank, the others know it and leave the store alone, and rank 0 leaves first: the launcher then names it as
        the job's first failure. A rank that Lightning's launcher started and that is to end with a non-zero
        ``status`` then waits for its parent to end."""
        rank_zero_failed = self.known == 0
        if self.rank == 0:
            if not rank_zero_failed:
                self.wait(lambda: self.count(DONE) >= self.world_size - 1 or until(), seconds)
        elif not (self.left_store or rank_zero_failed):
            self.left_store = True
            with contextlib.suppress(Exception):
                self.store.add(DONE, 1)
        if self.parent is not None and status != 0:
            self.wait(lambda: os.getppid() != self.parent, seconds)

    def announce(self, reason: str) -> None:
        """The job's one line about the ranks that stop: printed by the lowest rank among them."""
        failed = self.known if self.known is not None else 0
        if self.rank == (1 if failed == 0 else 0):
            others = ", as do the other ranks" if self.world_size > 2 else ""
            print(f"{PROG}: rank {self.rank} stopped{others}: {reason}", file=sys.stderr)


_job: _Job | None = None


def _job_of(trainer: Trainer | None) -> _Job | None:
    """The job of ``trainer``'s processes, or None in a single process or before the process group is set up."""
    global _job
    if trainer is None or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        # The store of the default group: private, but the one way to reach the store the group was set up with.
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    if _job is None or _job.store is not store:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        launched = isinstance(environment, LightningEnvironment) and trainer.local_rank != 0
        _job = _Job(store, trainer.global_rank, trainer.world_size, launched)
    return _job


def _watch(job: _Job) -> None:
    """The watchdog: ends this process once another rank has failed, after the grace."""
    while not job.stop.wait(POLL):
        try:
            failed = job.failed_rank()
        except Exception:  # the store is gone: rank 0 has ended, which the main thread meets if it matters
            return
        if failed is None or failed == job.rank:
            continue
        job.know(failed)
        if job.stop.wait(GRACE):
            return
        with job.lock:
            if not job.armed:  # this rank met an error of its own meanwhile, or an exception that says it all
                return
            job.announce(f"rank {failed} failed (see its message above)")
            job.leave_store(LINGER)
            _end_process(EXIT_STOPPED)


def _end_process(status: int) -> None:
    """End this process at once, whatever its main thread is waiting for, with its output written out."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    # Its loader workers hold this process's output open; they would outlive it by seconds.
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
    os._exit(status)


class RankFailureWatch(Callback):
    """Starts the watchdog once the process group is up, and stops it when the Trainer's run ends normally."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        job = _job_of(trainer)
        if job is not None:
            job.watch()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        job = _job_of(trainer)
        if job is not None and not job.failed:
            job.stop_watching()
            # a failure after the run's last collective ends rank 0's wait
            job.leave_store(LEAVE_WAIT, until=lambda: job.store.check([FAILED]), status=0)


def failed_here(trainer: Trainer | None) -> None:
    """This rank failed: its own error is printed now, or as a traceback when the process ends. Its watchdog stops
    at once. At its exit, after its error, this rank tells the others and waits, at most ``LINGER`` seconds, until
    they know."""
    job = _job_of(trainer)
    if job is None or job.failed:
        return
    job.failed = True
    job.stop_watching()
    atexit.register(_tell_the_others, job)  # the last registered runs first: before the loader workers are ended


def _tell_the_others(job: _Job) -> None:
    try:
        first = int(job.store.compare_set(FAILED, "", str(job.rank)))  # the first failed rank to report stays
    except Exception:  # the store is gone with rank 0, which has ended
        return
    job.know(first)
    if job.rank == 0 or first != 0:  # where rank 0 failed, it waits for the others to know, and they leave it be
        job.wait(lambda: job.count(KNOWN) >= job.world_size, LINGER)
    job.leave_store(LINGER)


def stopped_by_other_rank(trainer: Trainer | None) -> bool:
    """Whether this rank's exception comes from another rank's failure, which that rank's note in the store says.
    If so, the exception is left unprinted: the job's one line says that this rank stopped."""
    job = _job_of(trainer)
    if job is None:
        return False
    job.stop_watching()
    failed = job.known
    if failed is None:
        try:
            failed = job.failed_rank()
        except Exception:  # the store is gone with rank 0, which may have ended for any reason
            return False
    if failed is None or failed == job.rank:
        return False
    job.know(failed)
    job.announce(f"rank {failed} failed (see its message above)")
    job.leave_store(LINGER)
    return True


def leave_together(trainer: Trainer | None) -> None:
    """At the end of a command stopped by SIGTERM (exit status 143): wait until every rank has got here, at most
    ``LEAVE_WAIT`` seconds, so that no rank exits while another still writes. No collective: the store counts."""
    job = _job_of(trainer)
    if job is not None:
        _leave_together(job)


def _leave_together(job: _Job) -> None:
    job.stop_watching()
    for stream in (sys.stdout, sys.stderr):  # what this rank printed is out before any rank can be signalled
        stream.flush()
    with contextlib.suppress(Exception):
        job.store.add(LEAVING, 1)
    job.wait(lambda: job.count(LEAVING) >= job.world_size, LEAVE_WAIT)
    job.leave_store(LEAVE_WAIT)
