"""Files that a kill -9 never leaves half-written.

The bytes go to a hidden temporary file beside the target (``.<name>.tmp-<pid>``: same directory, so the final
``os.replace`` is one rename, which POSIX makes atomic within a directory), are flushed and fsynced, and replace
the target in one step; the directory is fsynced too, so the rename itself survives a power cut. Readers see
either the old file or the complete new one. (Lightning's fsspec transaction stages files in the system temp
directory instead: across filesystems that final move is a copy, which a kill can cut short.)

Every file gets the permissions an ordinary ``open(path, "w")`` gives (0666 less the umask: 0644 under the
usual 022), so colleagues sharing a cluster can read outputs. The temporary file is created by ``open`` (unlike
``tempfile.mkstemp``, always 0600); files that other code creates 0600 (safetensors' ``save_file``) are given
those permissions with ``give_ordinary_permissions``.
"""

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import IO, Any, Literal, overload

from robust_lightning.errors import UserError

TEMPORARY_MARK = ".tmp-"  # in every temporary name: a stale one left by a killed process is recognisable


def temporary_path(path: str | os.PathLike[str]) -> Path:
    """Where ``atomic_write`` stages ``path``: hidden, beside it, unique per process."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}")


@overload
def atomic_write(path: str | os.PathLike[str], mode: Literal["w"] = "w") -> AbstractContextManager[IO[str]]: ...
@overload
def atomic_write(path: str | os.PathLike[str], mode: Literal["wb"]) -> AbstractContextManager[IO[bytes]]: ...
@contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO[Any]]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` changes only when the block completes.
    ``mode``: "w" (text) or "wb" (bytes). The parent directory is created if missing."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    temporary = temporary_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a stale one (a killed process of the same pid: pids repeat in containers) would keep its own permissions
        temporary.unlink(missing_ok=True)
        with open(temporary, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as e:
        with suppress(OSError):  # on a full or read-only disk the clean-up may fail too
            temporary.unlink(missing_ok=True)
        if isinstance(e, OSError):  # read-only, full, not a folder, ...: one message, the target left as it was
            raise UserError(f"cannot write {path}: {e.strerror or e}") from e
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def atomic_folder_files(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """``with atomic_folder_files(folder) as staging:`` files written into ``staging`` (code of others may write
    them) replace their namesakes in ``folder`` only when the block completes; other files of ``folder`` stay.

    ``staging`` is a hidden folder inside ``folder`` (``.staging.tmp-<pid>``): on the same filesystem whatever
    ``folder`` is (a symlink, a mount point), and writable wherever ``folder`` is. Each file moves in by one rename.
    Once the first has moved, the others follow even if a stop (Ctrl-C, a tool command's SIGTERM) comes in between,
    so the folder never holds the files of two writes; only a process killed outright in those microseconds
    (``kill -9``, a crash) can leave it so. A process killed outright during the block leaves the staging folder
    behind; the next call of the same process id removes it."""
    folder = Path(os.path.abspath(folder))
    staging = temporary_path(folder / "staging")
    folder.mkdir(parents=True, exist_ok=True)  # its OSError names the part of the path that cannot be made
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        yield staging
        staged = sorted(staging.iterdir())
        for path in staged:  # the bytes on the disk before any file takes its place
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError):
            raise UserError(f"cannot write into {folder}: {e.strerror or e}") from e
        raise
    try:
        for path in staged:
            os.replace(path, folder / path.name)
    except OSError as e:  # a folder where a file goes, say: the files moved so far stay, the others are dropped
        raise UserError(f"cannot write into {folder}: {e.strerror or e}") from e
    except BaseException:  # a stop between two renames: the files not yet moved follow
        for path in staged:
            if path.exists():
                with suppress(OSError):
                    os.replace(path, folder / path.name)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _fsync_folder(folder)


def umask() -> int:
    """The process's umask, read without changing it where the kernel shows it (Linux 4.7+: ``Umask:`` in
    /proc/self/status). Elsewhere it can only be read by setting another and restoring it (``os.umask``), which is
    not thread-safe: a file another thread creates in between gets the interim mask, here the strict 077 rather
    than 0 (world-writable). Read at each call, not once at import, so a umask set later is followed."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def give_ordinary_permissions(path: str | os.PathLike[str]) -> None:
    """The permissions ``open(path, "w")`` would have given the file: 0666 less the umask."""
    os.chmod(path, 0o666 & ~umask())


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike[str], content: Any, indent: int | None = 2, **dump_options: Any) -> None:
    """JSON with a final newline; ``dump_options`` go to ``json.dump`` (e.g. sort_keys, default)."""
    with atomic_write(path) as f:
        json.dump(content, f, indent=indent, **dump_options)
        f.write("\n")
