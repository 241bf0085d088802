"""A process's start and exit, kept short: the cyclic garbage collector stays off the objects that imports create.
Also the third-party notices that every command would print and that say nothing to a user, silenced in one place
(:func:`third_party_notices_silenced`).

Importing torch, timm and Lightning creates hundreds of thousands of objects (functions, classes, module
dictionaries). Python's cyclic garbage collector walks over all of them many times while they import, and once
more while the process exits. None of these objects is garbage: modules live as long as the process. Skipping
that walking makes a process start and exit markedly sooner (benchmarks/RESULTS.md, "Start and exit"). Each
command, each DDP rank and each SLURM task starts a process, so the savings add up in sweeps and tests.

In the robust-lightning command the collector stays off from the package's imports to the end of the command's
(:func:`started_as_command`). Switching it on in between would make it walk every object imported so far once more:
about 0.3 s of CPU in a start of 3 s (benchmarks/RESULTS.md, "Start and exit").
"""

import atexit
import gc
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Whether the collector was on before a command's imports turned it off; the command turns it on again once they are
# done (leave_imported_objects_out_of_collections). After that, a pause is an ordinary one again.
_on_after_command_imports = False
_command_imports_done = False


def started_as_command() -> bool:
    """Whether this process is the robust-lightning command: the console script, or ``python -m robust_lightning``
    (``-m robust_lightning.__main__`` as Lightning's launcher starts the other DDP ranks). A library user's process,
    a test's or a sweep's own Python code is not."""
    if Path(sys.argv[0]).name == "robust-lightning":
        return True
    options = iter(getattr(sys, "orig_argv", [])[1:])
    for option in options:  # the interpreter's options, up to what it runs
        if option.startswith("-m"):  # "-m module" or "-mmodule"
            return (option[2:] or next(options, None)) in ("robust_lightning", "robust_lightning.__main__")
        if option in ("-W", "-X"):  # options whose value is the next word
            next(options, None)
        elif option.startswith("-c") or not option.startswith("-"):
            return False
    return False


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a block of imports, then back as it was; in the command, off until the
    command's imports are done."""
    global _on_after_command_imports
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled and started_as_command() and not _command_imports_done:
            _on_after_command_imports = True
        elif was_enabled:
            gc.enable()


def leave_imported_objects_out_of_collections() -> None:
    """For a command, once its imports are done: every object alive now is left out of later collections
    (``gc.freeze``), and the objects alive at exit are left out of the exit's. The collector is then on again if
    it was before the command's imports.

    Not for library use: a caller's own objects alive now would never be collected if they became garbage.
    """
    global _on_after_command_imports, _command_imports_done
    gc.freeze()
    _command_imports_done = True
    if _on_after_command_imports:
        _on_after_command_imports = False
        gc.enable()
    atexit.register(gc.freeze)  # atexit functions run before the interpreter's last collections


# Third-party warnings that a command would print and that say nothing a user can act on: (the start of the message,
# a regular expression; its category, subclasses included). Lightning's other warnings tell a user something (the
# logging interval longer than an epoch, srun not used on a SLURM machine) and are kept.
SILENCED_WARNINGS: list[tuple[str, type[Warning]]] = [
    # torch deprecates LeafSpec, which Lightning's own utilities/_pytree.py still uses: for Lightning to change
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # Lightning's default logger without tensorboard installed; the project's loggers are chosen (robust_lightning.
    # loggers): a missing tensorboard changes nothing
    (r"Starting from v1\.9\.0, `tensorboardX` has been removed", UserWarning),
    # advice for the author of an IterableDataset: the project's shard streams split their shards between the
    # DataLoader workers (data/datasets.py, ShardStream), so each worker's length is the one Lightning counts on
    (r"Your `IterableDataset` has `__len__` defined", UserWarning),
]
# Silenced in the commands that save no checkpoint (all but fit). Lightning warns when a checkpoint restored from
# another run folder leaves the best-checkpoint bookkeeping behind, which only a fit goes on to use; a fit resumed
# into a new folder keeps the warning, as its best checkpoint is then chosen afresh.
SILENCED_WARNINGS_OUTSIDE_FIT: list[tuple[str, type[Warning]]] = [
    (r"The dirpath has changed from", UserWarning),
]
# Lightning's info lines that advertise its cloud services ("💡 Tip: ... try installing litlogger", "...
# litmodels"), printed by every Trainer: they go to this logger, by rank_zero_info.
SILENCED_LOG_LINES = ("lightning.pytorch.utilities.rank_zero", "💡 Tip:")


class _DropLines(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


@contextmanager
def third_party_notices_silenced(command: str) -> Iterator[None]:
    """While a command runs: the warnings of SILENCED_WARNINGS (and, but in fit, SILENCED_WARNINGS_OUTSIDE_FIT) and
    the log lines of SILENCED_LOG_LINES are not printed; as they were afterwards."""
    logger_name, start = SILENCED_LOG_LINES
    logger, dropped = logging.getLogger(logger_name), _DropLines(start)
    with warnings.catch_warnings():
        for message, category in SILENCED_WARNINGS + (SILENCED_WARNINGS_OUTSIDE_FIT if command != "fit" else []):
            warnings.filterwarnings("ignore", message=message, category=category)
        logger.addFilter(dropped)
        try:
            yield
        finally:
            logger.removeFilter(dropped)
