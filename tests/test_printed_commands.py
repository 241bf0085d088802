"""Every command the tool prints for the user to run (an interrupted fit's resume advice, a shard repair, a sweep's
report) runs as printed in the shell the user has: ``robust-lightning ...`` where that name on PATH is the running
program, else the program as it was started (``.venv/bin/robust-lightning``, or the interpreter with ``-m
robust_lightning``): a fresh shell without the environment activated has no ``robust-lightning`` on PATH."""

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, tiny_config
from robust_lightning import errors
from robust_lightning.errors import user_command
from robust_lightning.training.interruption import resume_command

CONSOLE_SCRIPT = Path(sys.executable).parent / "robust-lightning"  # the environment's, as `make env` installs it
STEPS_PER_EPOCH = 6


def _script(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_console_script_started_by_its_path_is_printed_by_that_path(tmp_path, monkeypatch):
    script = _script(tmp_path / "venv" / "bin" / "robust-lightning")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["venv/bin/robust-lightning", "fit"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the environment not activated
    assert user_command("fit", "--config", "a b.yaml") == "venv/bin/robust-lightning fit --config 'a b.yaml'"
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")  # activated: the name on PATH is this program
    assert user_command("fit") == "robust-lightning fit"
    other = _script(tmp_path / "other" / "robust-lightning")  # another installation first on PATH
    monkeypatch.setenv("PATH", f"{other.parent}:{script.parent}:/usr/bin:/bin")
    assert user_command("fit") == "venv/bin/robust-lightning fit"


def test_python_m_robust_lightning_is_printed_with_its_interpreter_unless_the_name_is_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "venv" / "bin"
    _script(bin_dir / "robust-lightning")
    main = Path(errors.__file__).resolve().parent / "__main__.py"
    monkeypatch.setattr(sys, "argv", [str(main), "fit"])
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert (
        user_command("report", "runs/x") == f"{shlex.quote(str(bin_dir / 'python'))} -m robust_lightning report runs/x"
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # the console script of this interpreter's environment
    assert user_command("report", "runs/x") == "robust-lightning report runs/x"


def test_a_process_not_started_as_the_program_prints_its_name(monkeypatch):
    """The Python API, a sweep cell (sys.argv[0] is set to the name), a test calling main: no shell started it."""
    for started in ("robust-lightning", "-c", "/usr/lib/python3/site-packages/pytest/__main__.py"):
        monkeypatch.setattr(sys, "argv", [started, "fit"])
        assert resume_command(["fit", "--ckpt_path", "x.ckpt", "--config", "c.yaml"]) == (
            "robust-lightning fit --config c.yaml --ckpt_path last"
        )


def _without(bin_dir: Path) -> dict[str, str]:
    """The test's environment with bin_dir off PATH (a fresh shell: the environment not activated)."""
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() != bin_dir.resolve()]
    env = {
        **os.environ,
        "PATH": os.pathsep.join(path),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("VIRTUAL_ENV", None)
    return env


def _interrupt(command: list[str], cwd: Path, env: dict[str, str], record: Path, steps: int) -> str:
    """Runs command in a session of its own, SIGTERMs it once ``record`` lists ``steps`` trained steps, and returns
    its output; the fit exits 143."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.time() + 240
        while not record.exists() or len(record.read_text().splitlines()) < steps:
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.time() < deadline, f"no {steps} trained steps within 240 s"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143, output[-3000:]
    return output


def _printed_resume(output: str) -> str:
    found = re.findall(r"^resume with: (.*)$", output, re.M)
    assert len(found) == 1, output[-3000:]
    return found[0]


@pytest.mark.skipif(not CONSOLE_SCRIPT.is_file(), reason="no robust-lightning console script beside the interpreter")
def test_the_resume_command_of_an_interrupted_fit_runs_as_printed(tmp_path):
    """Started as `.venv/bin/robust-lightning` in a shell without the environment on PATH, the SIGTERMed fit prints
    a resume command by that path, which runs there and continues the run. Started again with the environment on
    PATH (activated), it prints `robust-lightning ...`, which runs there and finishes the run."""
    venv = CONSOLE_SCRIPT.parent.parent
    (tmp_path / ".venv").symlink_to(venv)  # the user's checkout: its environment at .venv/
    record = tmp_path / "batches.jsonl"
    pace = {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0.3}}
    tiny_config(
        tmp_path,
        **{
            "model.arch": "test_resnet",
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": STEPS_PER_EPOCH,
            "trainer.limit_val_batches": 1,
            "trainer.callbacks": [pace],
            "data.batch_size": 2,
            "data.source.init_args.train_per_class": STEPS_PER_EPOCH // 2,
        },
    )
    fresh_shell = _without(CONSOLE_SCRIPT.parent)
    assert shutil.which("robust-lightning", path=fresh_shell["PATH"]) is None
    output = _interrupt(
        [".venv/bin/robust-lightning", "fit", "--config", "tiny.yaml"], tmp_path, fresh_shell, record, 2
    )
    printed = _printed_resume(output)
    assert printed == ".venv/bin/robust-lightning fit --config tiny.yaml --ckpt_path last", output[-3000:]

    activated = {**fresh_shell, "PATH": os.pathsep.join([str(tmp_path / ".venv" / "bin"), fresh_shell["PATH"]])}
    stopped = len(record.read_text().splitlines())
    output = _interrupt(shlex.split(printed), tmp_path, activated, record, stopped + 2)  # as printed: it resumes
    assert "Restored all states from the checkpoint" in output, output[-3000:]
    printed = _printed_resume(output)
    assert printed == "robust-lightning fit --config tiny.yaml --ckpt_path last", output[-3000:]

    finished = subprocess.run(
        shlex.split(printed), cwd=tmp_path, env=activated, capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in record.read_text().splitlines()]
    assert steps[-1] == 2 * STEPS_PER_EPOCH and len(set(steps)) == len(steps)  # each step trained once, one run
    fit = json.loads((tmp_path / "runs" / "tiny" / "version_0" / "results.json").read_text())["fit"]
    assert fit["epochs"] == 2 and "interrupted" not in fit
    assert not (tmp_path / "runs" / "tiny" / "version_1").exists()
