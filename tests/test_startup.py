"""The collector pause of robust_lightning/startup.py: the command freezes what it imported; the library leaves
the caller's collector as it found it."""

import gc
import json
import subprocess
import sys

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
