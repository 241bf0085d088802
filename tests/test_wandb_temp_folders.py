"""wandb's import-time temporary folders (every robust-lightning process imports wandb, through timm) do not pile
up in the temporary directory when processes are killed with kill -9."""

import os
import signal
import socket
import subprocess
import sys

from robust_lightning.wandb_temp_folders import process_folder_name

IMPORT = "import robust_lightning, sys, time; print('ready', flush=True); time.sleep(float(sys.argv[1]))"


def _python(tmp_dir, seconds: float) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_dir)}
    return subprocess.Popen([sys.executable, "-c", IMPORT, str(seconds)], stdout=subprocess.PIPE, text=True, env=env)


def test_a_killed_process_folder_is_removed_by_the_next_process(tmp_path):
    host = socket.gethostname()
    other_host = tmp_path / process_folder_name(f"{host}-elsewhere", 999_999_999)  # a shared temporary directory
    other_host.mkdir()
    killed = _python(tmp_path, 3600)  # killed below; it must not end of itself while the test runs
    try:
        assert killed.stdout.readline() == "ready\n"
        folder = tmp_path / process_folder_name(host, killed.pid)
        # wandb's two folders are in the process's folder, not loose in the temporary directory
        assert sorted(p.name.partition("wandb-")[2] for p in folder.iterdir()) == ["artifacts", "media"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, other_host.name])

        # a process that exits normally removes its own folder and leaves a running process's
        finished = _python(tmp_path, 0)
        assert finished.communicate(timeout=120)[0] == "ready\n" and finished.returncode == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, other_host.name])
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert folder.is_dir()  # kill -9: nothing ran at exit

    successor = _python(tmp_path, 0)
    assert successor.communicate(timeout=120)[0] == "ready\n" and successor.returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == [other_host.name]  # another host's processes are not ours to judge
