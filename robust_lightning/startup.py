"""A process's start and exit, kept short: the cyclic garbage collector stays off the objects that imports create.

Importing torch, timm and Lightning creates hundreds of thousands of objects (functions, classes, module
dictionaries). Python's cyclic garbage collector walks over all of them many times while they import, and once
more while the process exits. None of these objects is garbage: modules live as long as the process. Skipping
that walking makes a process start and exit markedly sooner (benchmarks/RESULTS.md, "Start and exit"). Each
command, each DDP rank and each SLURM task starts a process, so the savings add up in sweeps and tests.
"""

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a block of imports, then back as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def leave_imported_objects_out_of_collections() -> None:
    """For a command, once its imports are done: every object alive now is left out of later collections
    (``gc.freeze``), and the objects alive at exit are left out of the exit's.

    Not for library use: a caller's own objects alive now would never be collected if they became garbage.
    """
    gc.freeze()
    atexit.register(gc.freeze)  # atexit functions run before the interpreter's last collections
