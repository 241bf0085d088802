"""The collector pause of robust_lightning/startup.py: the command freezes what it imported; the library leaves
the caller's collector as it found it."""

import gc
import json
import subprocess
import sys

import pytest

from helpers import REPO
from robust_lightning import startup
from robust_lightning.startup import collector_paused

# in a fresh interpreter: the collector's state after importing the package, then after importing the command
IMPORTS = """
import gc, json
states = {}
import robust_lightning
states["package"] = [gc.isenabled(), gc.get_freeze_count()]
import robust_lightning.cli
states["command"] = [gc.isenabled(), gc.get_freeze_count()]
print(json.dumps(states))
"""


def test_the_package_leaves_the_collector_on_and_the_command_freezes_its_imports():
    result = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=120, check=True)
    states = json.loads(result.stdout.splitlines()[-1])
    assert states["package"] == [True, 0]  # a library user's objects stay collectable
    enabled, frozen = states["command"]
    assert enabled and frozen > 100_000  # torch's, timm's and Lightning's objects, out of later collections


def test_a_collector_the_caller_turned_off_stays_off():
    was_enabled = gc.isenabled()
    try:
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()
        gc.enable()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        (gc.enable if was_enabled else gc.disable)()


# Loaded by the interpreter before the command (sitecustomize on PYTHONPATH): notes how many objects were frozen each
# time the collector is switched on again, and prints that list at exit.
NOTE_ENABLES = """
import atexit, gc, json, sys
frozen_at_enable = []
enable = gc.enable
gc.enable = lambda: (frozen_at_enable.append(gc.get_freeze_count()), enable())[1]
atexit.register(lambda: print("enables: " + json.dumps(frozen_at_enable), file=sys.stderr))
"""


def test_the_command_keeps_the_collector_off_until_its_imports_are_frozen(tmp_path):
    """Switched on between the package's imports and the command's, the collector would walk every object imported
    so far: in the command it first comes back on after the freeze."""
    (tmp_path / "sitecustomize.py").write_text(NOTE_ENABLES)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "robust_lightning", "--version"], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    enables = json.loads(result.stderr.split("enables: ")[-1])
    assert enables and enables[0] > 100_000, enables


@pytest.mark.parametrize(
    "argv, command",
    [
        (["python", "-m", "robust_lightning", "fit"], True),
        (["python", "-u", "-m", "robust_lightning.__main__", "fit"], True),  # Lightning's launcher, other ranks
        (["python", "-W", "ignore", "-mrobust_lightning"], True),
        (["/venv/bin/robust-lightning", "fit"], True),  # the console script
        (["python", "-m", "pytest", "tests"], False),
        (["python", "-c", "import robust_lightning", "-m", "robust_lightning"], False),
        (["python", "sweep.py", "-m", "robust_lightning"], False),
    ],
)
def test_the_command_is_told_from_other_processes_by_its_command_line(monkeypatch, argv, command):
    script = argv[0] if argv[0].endswith("robust-lightning") else argv[-1]
    monkeypatch.setattr(sys, "argv", [script])
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert startup.started_as_command() is command


def test_in_the_command_a_pause_after_the_freeze_is_an_ordinary_one(monkeypatch):
    """The command's imports keep the collector off until the freeze; a pause after it turns it back on."""
    monkeypatch.setattr(startup, "started_as_command", lambda: True)
    monkeypatch.setattr(startup, "_on_after_command_imports", False)
    monkeypatch.setattr(startup, "_command_imports_done", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)  # this test's process keeps its collections
    was_enabled = gc.isenabled()
    try:
        gc.enable()
        with collector_paused():
            pass
        assert not gc.isenabled()  # between the package's imports and the command's
        startup.leave_imported_objects_out_of_collections()
        assert gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        (gc.enable if was_enabled else gc.disable)()
