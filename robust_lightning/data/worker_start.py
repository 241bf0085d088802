"""Loader workers that are checked to have started, and started again where one never did.

Before Python 3.12, a child forked while another thread holds the interpreter's runtime lock waits for that lock
forever, before it runs any Python code (CPython gh-112275). Under DDP a rank forks its DataLoader workers while the
process group's threads run, and gloo's threads take that lock each time they release a tensor that Python created
(benchmarks/fork_race.py). A worker caught this way never delivers a batch, and the fit would wait for it forever.
:func:`robust_lightning.job_signals.shield_forked_children` makes such a fork rare; this module recovers from one.

Each forked worker reports its start through a pipe before it runs the loader's own ``worker_init_fn``. Where a
worker has not reported within ``start_limit`` seconds, the iterator's workers are killed (SIGKILL: a child stuck
in the fork runs no Python signal handler) and started again, with the random states the first start drew from,
so that the batches and their draws are those of a start that went well.
"""

import multiprocessing
import os
import select
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

ATTEMPTS = 3  # starts of an iterator's workers before the loader gives up


class WorkerStarted:
    """A ``worker_init_fn`` that first reports the worker's start (one byte to ``fd``, where set), then runs
    ``init``."""

    def __init__(self, init: Callable[[int], object] | None) -> None:
        self.init = init
        self.fd: int | None = None  # set by the loader for the forks of one start of its workers

    def __call__(self, worker_id: int) -> None:
        if self.fd is not None:
            os.write(self.fd, b"\x01")
        if self.init is not None:
            self.init(worker_id)


class StartCheckedLoader(DataLoader[Any]):
    """A DataLoader whose forked workers are checked to have started within ``start_limit`` seconds, and are started
    again where one has not (robust_lightning/data/worker_start.py)."""

    start_limit = 60.0  # seconds: a forked worker reports its start in milliseconds

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.worker_init_fn, WorkerStarted):  # Lightning may build a loader again from this one
            self.worker_init_fn = WorkerStarted(self.worker_init_fn)

    def _forks_workers(self) -> bool:
        context = self.multiprocessing_context
        # allow_none: asking the default context its method would fix it, and a later set_start_method would fail
        default = torch.multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        method = context.get_start_method() if context is not None else default
        return self.num_workers > 0 and method == "fork"

    def _get_iterator(self) -> Any:
        if not self._forks_workers():
            return super()._get_iterator()
        report = self.worker_init_fn
        assert isinstance(report, WorkerStarted)
        states = torch.get_rng_state(), self.generator.get_state() if self.generator is not None else None
        for attempt in range(1, ATTEMPTS + 1):
            read, write = os.pipe()
            report.fd = write
            try:
                iterator = super()._get_iterator()
            finally:
                report.fd = None
                os.close(write)
            started = _starts(read, self.num_workers, self.start_limit)
            if started == self.num_workers:
                return iterator
            _kill_workers(iterator)
            torch.set_rng_state(states[0])
            if self.generator is not None and states[1] is not None:
                self.generator.set_state(states[1])
            warnings.warn(
                f"{self.num_workers - started} of {self.num_workers} loader workers did not start within "
                f"{self.start_limit:.0f} s (a fork caught by CPython gh-112275 before Python 3.12; docs/clusters.md)"
                + (f": starting them again ({attempt + 1} of {ATTEMPTS})" if attempt < ATTEMPTS else ""),
                stacklevel=2,
            )
        raise RuntimeError(
            f"the loader's workers did not start in {ATTEMPTS} attempts of {self.start_limit:.0f} s each "
            "(docs/clusters.md, 'Python before 3.12')"
        )


def _starts(read: int, expected: int, limit: float) -> int:
    """The starts reported on the pipe ``read`` (closed here) within ``limit`` seconds, up to ``expected``."""
    started, deadline = 0, time.monotonic() + limit
    try:
        while started < expected:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                break
            reported = os.read(read, expected - started)
            if not reported:  # every worker's end of the pipe closed: they are gone
                break
            started += len(reported)
    finally:
        os.close(read)
    return started


def _kill_workers(iterator: Any) -> None:
    """Kill the workers of a multi-process iterator (torch's _MultiProcessingDataLoaderIter) and shut it down.
    Torch's SIGCHLD watch is told first, or it would take the kill for a worker's failure."""
    if iterator._worker_pids_set:
        torch._C._remove_worker_pids(id(iterator))  # what torch's _shutdown_workers calls for it
        iterator._worker_pids_set = False
    for worker in iterator._workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    iterator._shutdown_workers()
