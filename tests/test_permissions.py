"""Every file the tool writes gets the permissions of an ordinary ``open(path, "w")``, 0666 less the umask, so a
group sharing a cluster can read the outputs: exports (a timm folder, a weights file), checkpoints, results.json,
outcome folders and anything else written through robust_lightning.atomic."""

import os
import stat
from pathlib import Path

import pytest
import torch

from helpers import write_checkpoint
from robust_lightning import atomic
from robust_lightning.atomic import atomic_write_text, temporary_path, umask
from robust_lightning.evaluation.outcomes import append_record, claim_directory
from robust_lightning.evaluation.results import ResultsFile
from robust_lightning.training.checkpoint_io import AtomicCheckpointIO
from robust_lightning.training.export import export


@pytest.fixture(params=[(0o022, 0o644), (0o077, 0o600)], ids=["umask-022", "umask-077"])
def umask_and_mode(request):
    """(umask set for the test, the mode its new files must have); the test's umask is restored after it."""
    mask, mode = request.param
    before = os.umask(mask)
    yield mask, mode
    os.umask(before)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_follow_the_umask(tmp_path, umask_and_mode):
    mask, mode = umask_and_mode
    assert umask() == mask
    checkpoint = tmp_path / "model.ckpt"
    write_checkpoint(checkpoint, arch="test_resnet")
    assert export(str(checkpoint), str(tmp_path / "timm-folder")) == 0
    assert export(str(checkpoint), str(tmp_path / "weights.safetensors")) == 0
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "ckpts" / "last.ckpt")
    ResultsFile.of(tmp_path).write({"test": {"acc1": 0.5}})
    atomic_write_text(tmp_path / "note.txt", "text")
    outcomes = tmp_path / "outcomes"
    claim_directory(outcomes, {"n_iter": 5}, True, "AutoAttackEvaluation")
    append_record(
        outcomes / "rank0.jsonl",
        {"key": ["a"], "label": [0], "clean": [True], "robust": [True], "broken_by": [None], "seconds": {}},
    )

    written = [
        tmp_path / "timm-folder" / "model.safetensors",
        tmp_path / "timm-folder" / "config.json",
        tmp_path / "weights.safetensors",
        tmp_path / "ckpts" / "last.ckpt",
        tmp_path / "results.json",
        tmp_path / "note.txt",
        outcomes / "manifest.json",
        outcomes / "rank0.jsonl",
    ]
    assert {path.name: oct(mode_of(path)) for path in written} == {path.name: oct(mode) for path in written}


def test_a_stale_temporary_file_does_not_pass_its_permissions_on(tmp_path, umask_and_mode):
    _, mode = umask_and_mode
    target = tmp_path / "results.json"
    stale = temporary_path(target)  # left by a killed process that had this pid
    stale.write_text("half")
    stale.chmod(0o400)
    atomic_write_text(target, "whole")
    assert target.read_text() == "whole" and mode_of(target) == mode and not stale.exists()


def test_the_umask_is_read_without_proc_too(umask_and_mode, monkeypatch):
    """Where /proc/self/status is unreadable (not Linux), the umask is read by setting one and restoring it."""
    mask, _ = umask_and_mode

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(atomic, "open", no_proc, raising=False)
    assert umask() == mask
    monkeypatch.undo()
    assert umask() == mask  # left as it was
