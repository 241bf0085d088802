"""wandb's import-time temporary folders, kept where a killed process's are found and removed.

Importing wandb (timm imports it, so every robust-lightning process does) makes two folders in the system's
temporary directory, ``tmp*wandb-media`` and ``tmp*wandb-artifacts`` (``wandb/sdk/data_types/_private.py``,
``wandb/sdk/artifacts/artifact.py``). wandb removes them at exit; a process killed with ``kill -9`` cannot. Here
they go into a folder of this process, ``robust-lightning-<host>-<pid>`` in the temporary directory. A process
that exits removes its folder; each robust-lightning process that starts removes those of dead processes of its
host. Folders of running processes, of other hosts (a shared temporary directory) and of other users are left.
"""

import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import weakref
from pathlib import Path

PREFIX = "robust-lightning-"


def process_folder_name(host: str, pid: int | str) -> str:
    return f"{PREFIX}{host}-{pid}"


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_folders_of_dead_processes(parent: Path, host: str) -> list[Path]:
    """Remove the process folders in ``parent`` of this host whose process no longer runs; returns them."""
    removed = []
    for folder in parent.glob(process_folder_name(host, "*")):
        pid = folder.name.removeprefix(process_folder_name(host, ""))
        if pid.isdigit() and int(pid) != os.getpid() and _process_is_gone(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class _Owner:
    """Lives as long as the interpreter; its finaliser removes the process folder at exit."""


_owner = _Owner()


def _remove_if_owner(folder: Path, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # a forked child exiting leaves its parent's folder alone
        shutil.rmtree(folder, ignore_errors=True)


def import_wandb_into_process_folder() -> None:
    """Import wandb with the temporary directory pointed at this process's folder (nothing when wandb is absent
    or already imported). Only wandb's import-time folders go there: the temporary directory is restored after."""
    if "wandb" in sys.modules or importlib.util.find_spec("wandb") is None:
        return
    parent, host = Path(tempfile.gettempdir()), socket.gethostname()
    folder = parent / process_folder_name(host, os.getpid())
    try:
        remove_folders_of_dead_processes(parent, host)
        folder.mkdir(mode=0o700, exist_ok=True)
    except OSError:  # a temporary directory we cannot list or write: wandb's folders go where it puts them
        return
    # created before wandb's own finalisers, so it runs after them at exit (newest first)
    weakref.finalize(_owner, _remove_if_owner, folder, os.getpid())
    previous, tempfile.tempdir = tempfile.tempdir, str(folder)
    try:
        import wandb.sdk.artifacts.artifact
        import wandb.sdk.data_types._private  # noqa: F401
    except ImportError:  # a broken wandb: timm, which imports it too, carries on without it
        pass
    finally:
        tempfile.tempdir = previous
