"""Dependencies that one feature needs (docs/dependencies.md): the package imports and its commands start without
them, and the feature names the extra to install where it is missing. wandb-workspaces is the extra ``workspace``,
for ``robust-lightning workspace``. kornia is no longer a dependency (tests/test_spatial_warp.py checks the spatial
attack's own warp against it): the package starts without it."""

import json
import subprocess
import sys

import pytest

from robust_lightning.cli import main
from robust_lightning.errors import UserError

WORKSPACE_MESSAGE = "robust-lightning workspace needs wandb-workspaces: pip install 'robust-lightning[workspace]'"
# the optional packages, and kornia, which the tests alone install
ABSENT = ("wandb_workspaces", "kornia")


def block(monkeypatch, package: str) -> None:
    """Import of the package and of its submodules raises ImportError, as where it is not installed, even where
    an earlier test imported it."""
    for name in [name for name in sys.modules if name == package or name.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


def test_the_workspace_command_names_its_extra_where_wandb_workspaces_is_missing(monkeypatch, capsys):
    block(monkeypatch, "wandb_workspaces")
    assert main(["workspace", "--project", "robust-lightning", "--dry_run", "true"]) == 2
    assert capsys.readouterr().err == f"robust-lightning: error: {WORKSPACE_MESSAGE}\n"
    # saving (W&B online, with a key it never sends): the same message, not the one about W&B's network
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert main(["workspace", "--project", "robust-lightning", "--entity", "my-team"]) == 2
    assert capsys.readouterr().err == f"robust-lightning: error: {WORKSPACE_MESSAGE}\n"


def test_the_workspace_from_python_names_its_extra_where_wandb_workspaces_is_missing(monkeypatch):
    from robust_lightning.scale.workspace import build_workspace

    block(monkeypatch, "wandb_workspaces")
    with pytest.raises(UserError) as error:
        build_workspace("ENTITY", "robust-lightning", "robust-lightning")
    assert str(error.value) == WORKSPACE_MESSAGE


# A fresh process, where nothing was imported before the packages were made absent: the package imports, every
# command's help prints, the spatial attack runs, and the workspace command gives its one line.
WITHOUT = """
import contextlib, io, json, sys
for name in {absent!r}:
    sys.modules[name] = None
import torch
import robust_lightning
from robust_lightning.attacks import spatial_grid_attack
from robust_lightning.cli import main

outcomes = {{}}
for command in (["--help"], ["fit", "--help"], ["test", "--help"], ["workspace", "--help"],
                ["workspace", "--dry_run", "true"]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(command)
        except SystemExit as exit:
            code = exit.code or 0
    outcomes[" ".join(command)] = [code, out.getvalue(), err.getvalue()]
x = torch.rand(2, 3, 8, 8)
result = spatial_grid_attack(lambda images: images.flatten(1)[:, :4], x, torch.zeros(2, dtype=torch.long),
                             translations=3, max_shift=2.0, rotations=3, max_angle=10.0)
outcomes["spatial"] = list(result.correct.shape)
print(json.dumps(outcomes))
"""


def test_the_package_and_its_commands_start_without_the_optional_packages():
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT.format(absent=ABSENT)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    for command in ("--help", "fit --help", "test --help", "workspace --help"):
        code, out, err = outcomes[command]
        assert code == 0 and "usage" in out.lower(), (command, out[-500:], err[-500:])
    code, out, err = outcomes["workspace --dry_run true"]
    assert (code, out, err) == (2, "", f"robust-lightning: error: {WORKSPACE_MESSAGE}\n")
    assert outcomes["spatial"] == [2, 27]
