"""How often does a forked child hang when it is forked while gloo's threads take Python's runtime lock?

A DDP fit forks its data loader workers from a rank process in which the process group's threads run. When a gloo
thread finishes a collective on a tensor that Python created, it releases that tensor's Python object. To do so it
creates a Python thread state, and that holds the interpreter's runtime lock (HEAD_LOCK) for a moment, without the
GIL. If the rank forks in that moment, the child inherits the lock held. CPython 3.11.7, the interpreter of this
project's machines, then waits for that lock in the child's post-fork set-up, before any Python code runs, and the
child never starts (CPython gh-112275; Python 3.12 reinitialises the lock first). The data loader then waits for its
worker forever. The suite met it: in one full run, a 2-rank fit's first loader worker hung in ``os.fork``.

This script makes the moment frequent. In each of several processes, a one-rank gloo group runs asynchronous
all-reduces whose tensors only gloo's threads hold, while the main thread forks children that exit at once. A child
that has not exited after 3 seconds counts as hung and is killed. The same runs are repeated with a before-fork hook
that takes and releases the runtime lock, as the robust-lightning command registers it before Python 3.12
(robust_lightning.job_signals.shield_forked_children). It narrows the window without closing it.

    python benchmarks/fork_race.py                       # 3 processes x 40 s per variant, about 90 s on 2 cores
    python benchmarks/fork_race.py --processes 4 --seconds 60

It prints, per variant, the forks made and the children that hung.
"""

import argparse
import os
import subprocess
import sys
import threading
import time

HANG_SECONDS = 3.0


def race(port: int, seconds: float, wait_for_runtime_lock: bool) -> tuple[int, int]:
    """Forks and hung children of one process: forks for ``seconds`` while gloo's threads release tensors."""
    import torch
    import torch.distributed as dist

    if wait_for_runtime_lock:  # as the robust-lightning command does: its before-fork hook on Python 3.11
        from robust_lightning.job_signals import shield_forked_children

        shield_forked_children()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    stop = threading.Event()

    def all_reduces() -> None:
        while not stop.is_set():
            for _ in range(32):  # nothing in Python keeps the work or the tensor: gloo's thread releases both
                dist.all_reduce(torch.ones(2), async_op=True)
            dist.all_reduce(torch.ones(2))

    threading.Thread(target=all_reduces, daemon=True).start()
    forks = hung = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        child = os.fork()
        if child == 0:
            os._exit(0)
        forks += 1
        deadline = time.monotonic() + HANG_SECONDS
        while not os.waitpid(child, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                hung += 1
                os.kill(child, 9)
                os.waitpid(child, 0)
                break
            time.sleep(0.0005)
    stop.set()
    return forks, hung


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3, help="processes racing at once (more than the cores)")
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of forking per process")
    parser.add_argument("--one", nargs=3, metavar=("PORT", "SECONDS", "WAIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one racing process, started by main()
        forks, hung = race(int(args.one[0]), float(args.one[1]), args.one[2] == "1")
        print(forks, hung, flush=True)
        os._exit(0)  # gloo's threads are still running: leave without joining them
    print(f"Python {sys.version.split()[0]}, {args.processes} processes x {args.seconds:.0f} s per variant")
    for wait in (False, True):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        runs = [
            subprocess.Popen(
                [sys.executable, __file__, "--one", str(29740 + 10 * wait + i), str(args.seconds), str(int(wait))],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(args.processes)
        ]
        counts = [tuple(map(int, run.communicate()[0].split())) for run in runs]
        forks, hung = sum(c[0] for c in counts), sum(c[1] for c in counts)
        name = "before-fork hook waits for the runtime lock" if wait else "plain fork"
        print(f"{name:45s} forks {forks:6d}  hung children {hung:3d}  ({hung / max(forks, 1):.2%})")


if __name__ == "__main__":
    main()
