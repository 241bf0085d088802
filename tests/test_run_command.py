"""helpers.run_command, which runs every command of the tests: a command that runs past its time limit fails its
test with where each of its processes was, and leaves no process behind."""

import time
from pathlib import Path

import pytest

from helpers import run_command

# a command that hangs in a process it started, as a DDP rank or a loader worker would
CHILD = "import time\\ndef waits_for_ever():\\n    time.sleep(600)\\nwaits_for_ever()"
HANGS = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "{CHILD}"])
print(child.pid, flush=True)
def waits_for_its_child():
    child.wait()
waits_for_its_child()
"""


def test_a_command_past_its_limit_fails_with_the_stacks_of_its_processes(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(pytest.fail.Exception) as failed:
        run_command([], cwd=tmp_path, timeout=5, script=script)
    message = str(failed.value)
    assert "did not end within 5 s" in message and "where its processes were:" in message
    assert "waits_for_its_child" in message and "waits_for_ever" in message, message  # both processes' stacks
    child = message.split("killed with every process it started):\n")[1].split()[0]
    deadline = time.monotonic() + 10  # SIGKILL is delivered, and the dead child reaped, a moment later
    while state(child) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state(child) in (None, "Z")  # gone, or dead and not yet reaped


def state(pid: str) -> str | None:
    """The process's state letter (Z: dead, not reaped), or None when it is gone."""
    try:
        return (Path("/proc") / pid / "stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None
