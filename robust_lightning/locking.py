"""One writer at a time for a directory that two processes could write (shards, a run, an outcome folder).

``exclusive(lock_file, what)`` holds an ``fcntl.flock`` lock on ``lock_file`` for the duration of a ``with``
block, or stops at once with a UserError naming the process that holds it. The operating system releases a flock
lock when its holder exits, however it exits (kill -9 included), so a crashed writer never leaves the directory
locked; the file itself stays (removing it would let a third process lock a new file while a second still holds
the old one) and records the holder (pid, host, command, start time) for the message. flock works within one
host; on network filesystems it depends on the server (NFSv4 and Lustre support it).
"""

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from robust_lightning.errors import UserError

LOCK_NAME = ".lock"  # the lock file's name inside the directory it guards

# Descriptors of the locks this process holds. A forked child (a DataLoader or shard worker) closes its copies:
# a flock lock lasts until every descriptor sharing it is closed, so a worker that outlives a killed parent
# would otherwise keep the lock. (Executed programs never get them: Python opens files non-inheritable.)
_held: set[int] = set()


def _close_in_child() -> None:
    for fd in _held:
        with suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _holder(fd: int) -> str:
    """Who holds the lock, as recorded in the lock file."""
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        info = json.loads(text)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):  # the holder has not written its details yet
        return "another process"


@contextmanager
def exclusive(lock_file: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Hold the lock on ``lock_file`` (created with its directory if missing) while the block runs; ``what``
    names the thing it guards in the error message, e.g. "shard directory /data/train"."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"{what} is being written by {_holder(fd)}; wait for it to finish or stop it "
                f"(the lock, {lock_file}, is released as soon as that process ends)"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _held.add(fd)
        yield
    finally:
        _held.discard(fd)
        os.close(fd)  # releases the lock
