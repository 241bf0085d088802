"""`make quickstart` after an interrupted quickstart continues it (README: the natural retry); a finished stage is not
run again; `make quickstart-fresh` starts over. The Makefile's real recipe, in a directory of its own, on the
shipped quickstart configs shrunk to a tiny model and a few images (a whole quickstart takes minutes)."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")
CONSOLE_SCRIPT = Path(sys.executable).parent / "robust-lightning"
STEPS_PER_EPOCH = 6


def _shrunk(name: str, tmp_path: Path, **overrides) -> None:
    """configs/NAME.yaml with the tiny settings, into tmp_path/configs/."""
    config = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    settings = {
        "model.arch": "test_resnet",
        "trainer.limit_val_batches": 1,
        "trainer.enable_progress_bar": False,
        "data.batch_size": 2,
        "data.num_workers": 0,
        "data.source.init_args.num_classes": 4,
        "data.source.init_args.train_per_class": STEPS_PER_EPOCH // 2,
        "data.source.init_args.val_per_class": 1,
        "data.source.init_args.image_size": 32,
        "data.source.init_args.root": str(tmp_path / "synthetic"),
        **overrides,
    }
    for dotted, value in settings.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    (tmp_path / "configs").mkdir(exist_ok=True)
    (tmp_path / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A directory with the Makefile, the shrunk quickstart configs and an installed environment (venv/: its
    robust-lightning the test environment's console script, its .installed newer than pyproject.toml)."""
    if not CONSOLE_SCRIPT.is_file():
        pytest.skip("no robust-lightning console script beside the interpreter")
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "robust-lightning").symlink_to(CONSOLE_SCRIPT)
    (tmp_path / "venv" / ".installed").touch()
    os.utime(tmp_path / "pyproject.toml", (0, 0))
    _shrunk("quickstart_clean", tmp_path, **{"trainer.max_epochs": 1, "trainer.limit_train_batches": 3})
    record = tmp_path / "stage2.jsonl"
    pace = {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0.3}}
    stage2 = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["trainer"]["callbacks"]
    stage2[0]["init_args"]["fit_images"] = 2  # the AutoAttack at the end, on 2 images
    _shrunk(
        "quickstart",
        tmp_path,
        **{
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": STEPS_PER_EPOCH,
            "trainer.callbacks": [*stage2, pace],
            "model.select_attack_steps": 1,
        },
    )
    return tmp_path


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def _make(checkout: Path, target: str, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", target, "VENV=venv", *options],
        cwd=checkout,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _interrupted_quickstart(checkout: Path, record: Path, steps: int) -> str:
    """`make quickstart`, SIGTERMed (make and the fit, as a terminal or a scheduler signals the job) once stage 2
    trained ``steps`` steps; make waits for the fit (the recipe execs it), so its output ends with the fit's."""
    process = subprocess.Popen(
        ["make", "--no-print-directory", "quickstart", "VENV=venv"],
        cwd=checkout,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while not record.exists() or len(record.read_text().splitlines()) < steps:
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.time() < deadline, f"stage 2 trained no {steps} steps within 240 s"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0 and "fit interrupted by SIGTERM" in output, output[-3000:]
    return output


def _files(run: Path) -> dict[Path, int]:
    """The files of a stage's folder and their modification times (the Makefile's marker left out)."""
    return {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != ".quickstart_finished"}


def test_make_quickstart_continues_an_interrupted_quickstart_and_skips_finished_stages(checkout):
    record = checkout / "stage2.jsonl"
    output = _interrupted_quickstart(checkout, record, 2)
    clean, adversarial = checkout / "runs" / "quickstart_clean", checkout / "runs" / "quickstart"
    assert (clean / ".quickstart_finished").is_file(), output[-3000:]
    assert not (adversarial / ".quickstart_finished").exists()
    fit = json.loads((adversarial / "version_0" / "results.json").read_text())["fit"]
    assert fit["interrupted"] == "SIGTERM" and 2 <= fit["steps"] < STEPS_PER_EPOCH, output[-3000:]
    stage1 = _files(clean)

    # the natural retry: stage 1 is not run again, stage 2 continues its run from its checkpoint
    retry = _make(checkout, "quickstart")
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert re.search(
        r"Restored all states from the checkpoint at \S*runs/quickstart/checkpoints/last\.ckpt", retry.stderr
    )
    assert _files(clean) == stage1
    steps = [json.loads(line)["step"] for line in record.read_text().splitlines()]
    assert steps[-1] == 2 * STEPS_PER_EPOCH and len(set(steps)) == len(steps)  # each step trained once
    fit = json.loads((adversarial / "version_0" / "results.json").read_text())["fit"]
    assert fit["epochs"] == 2 and "interrupted" not in fit
    assert sorted(p.name for p in adversarial.glob("version_*")) == ["version_0"]  # one run, continued
    assert (adversarial / ".quickstart_finished").is_file()

    # finished: nothing runs again
    results = (adversarial / "version_0" / "results.json").stat().st_mtime_ns
    again = _make(checkout, "quickstart")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Restored" not in again.stderr and "fit finished" not in again.stdout
    assert (adversarial / "version_0" / "results.json").stat().st_mtime_ns == results

    # starting over is a target of its own, which deletes both runs first
    plan = _make(checkout, "quickstart-fresh", "-n")
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    removal = lines.index("rm -rf runs/quickstart_clean runs/quickstart")
    first_fit = next(i for i, line in enumerate(lines) if "configs/quickstart_clean.yaml --ckpt_path last" in line)
    assert removal < first_fit
    assert (clean / ".quickstart_finished").is_file()  # -n: nothing was removed


def test_make_quickstart_runs_no_removal():
    """The recipe of `make quickstart` deletes nothing (the README's set-up section names quickstart-fresh)."""
    plan = subprocess.run(
        ["make", "-n", "--no-print-directory", "quickstart", "VENV=.venv"], cwd=REPO, capture_output=True, text=True
    )
    assert plan.returncode == 0, plan.stderr
    assert "rm " not in plan.stdout and plan.stdout.count("--ckpt_path last") == 2, plan.stdout
