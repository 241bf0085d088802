"""robust-lightning sweep / report without a cluster: grid expansion, cell ids, skipping done cells, the array
script, the task wrapper's bookkeeping and the merged report (tests/test_slurm.py runs them on real SLURM)."""

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO, run_command, tiny_config
from robust_lightning import cli
from robust_lightning.cli import main
from robust_lightning.errors import UserError
from robust_lightning.evaluation.results import ResultsFile
from robust_lightning.job_signals import shield_forked_children
from robust_lightning.scale import report as report_module
from robust_lightning.scale.sweep import cell_state
from robust_lightning.scale.sweep_spec import expand, load_sweep
from robust_lightning.scale.task import run_cell, slurm_layout
from robust_lightning.training.interruption import EXIT_SIGTERM


def write_sweep(tmp_path: Path, **spec) -> Path:
    base = {
        "name": "demo",
        "command": "test",
        "configs": [str(REPO / "configs" / "eval" / "quickstart_autoattack.yaml")],
        "args": {"data.eval_limit": 16},
        "grid": {
            "ckpt_path": {"a": "/weights/a.ckpt", "b": "/weights/b.ckpt"},
            "data.image_size": [32, 48],
            "benchmark": {
                "clean": {"args": {"trainer.callbacks": []}},
                "aa": {"args": {"trainer.callbacks.init_args.version": "apgd-ce"}},
            },
        },
        "output_dir": str(tmp_path / "out"),
        "slurm": {"partition": "gpu", "gpus_per_node": 1, "max_parallel": 3, "setup": "module load cuda"},
    }
    base.update(spec)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def mark(cell_dir: Path, status: str, **sections) -> None:
    ResultsFile.of(cell_dir).write({**sections, "sweep": {"status": status, "cell": cell_dir.name}})


def test_grid_expands_to_the_product_with_every_value_in_its_cell(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path))
    cells = expand(sweep)
    assert len(cells) == 2 * 2 * 2
    # the last axis varies fastest; labels name the values
    assert [tuple(c.labels.values()) for c in cells[:3]] == [
        ("a", "32", "clean"),
        ("a", "32", "aa"),
        ("a", "48", "clean"),
    ]
    cell = cells[5]  # b, 32, aa
    assert cell.labels == {"ckpt_path": "b", "data.image_size": "32", "benchmark": "aa"}
    argv = cell.argv
    assert argv[:3] == ["test", "--config", str(REPO / "configs" / "eval" / "quickstart_autoattack.yaml")]
    assert "--data.eval_limit=16" in argv and "--trainer.callbacks.init_args.version=apgd-ce" in argv
    assert "--ckpt_path=/weights/b.ckpt" in argv and "--data.image_size=32" in argv
    assert "--trainer.callbacks=[]" in cells[4].argv and "--trainer.callbacks=[]" not in argv
    # everything the cell writes goes to its own directory
    assert cell.dir == tmp_path / "out" / "cells" / cell.id
    assert f"--trainer.default_root_dir={cell.dir}" in argv
    assert f"--checkpoint.dirpath={cell.dir / 'checkpoints'}" in argv
    loggers = json.loads(next(a for a in argv if a.startswith("--trainer.logger=")).split("=", 1)[1])
    assert loggers == [
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(cell.dir), "name": "", "version": ""},
        }
    ]


def test_cell_ids_are_readable_stable_and_unique(tmp_path):
    first = [c.id for c in expand(load_sweep(write_sweep(tmp_path)))]
    assert first == [c.id for c in expand(load_sweep(write_sweep(tmp_path)))]
    assert len(set(first)) == len(first)
    assert first[0].startswith("ckpt_path=a__image_size=32__benchmark=clean__")
    # a new value adds cells without renaming the others; a changed value renames only its cells
    path = write_sweep(
        tmp_path,
        grid={
            "ckpt_path": {"a": "/weights/a.ckpt", "b": "/weights/b2.ckpt"},
            "data.image_size": [32, 48, 64],
            "benchmark": {
                "clean": {"args": {"trainer.callbacks": []}},
                "aa": {"args": {"trainer.callbacks.init_args.version": "apgd-ce"}},
            },
        },
    )
    second = [c.id for c in expand(load_sweep(path))]
    assert set(first[:4]) < set(second)  # the "a" cells at 32 and 48
    assert not set(first[4:]) & set(second)  # b's checkpoint changed


@pytest.mark.parametrize(
    "change, message",
    [
        ({"grid": {"data.image_size": [32, 32.0]}}, "same label"),
        ({"grid": {"data image size": [32]}}, "expected a config key"),
        ({"grid": {"data.image_size": []}}, "non-empty"),
        ({"grid": {"benchmark": {"x": {"args": {}}, "y": {"configs": "no-list.yaml"}}}}, "a bundle is"),
        ({"colour": "blue"}, "unknown key(s) colour"),
        ({"command": "predict"}, "command must be one of"),
        ({"configs": ["configs/eval/nope.yaml"]}, "config file configs/eval/nope.yaml not found"),
        ({"slurm": {"array": "0-3"}}, "slurm.array is set by the sweep"),
    ],
)
def test_bad_sweep_files_are_refused_with_one_message(tmp_path, change, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_sweep(write_sweep(tmp_path, **change))


def test_loggers_of_the_configs_are_kept_and_pointed_at_the_cell(tmp_path):
    extra = tmp_path / "wandb.yaml"
    extra.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "logger": [
                        {
                            "class_path": "lightning.pytorch.loggers.CSVLogger",
                            "init_args": {"save_dir": "runs", "name": "x"},
                        },
                        {
                            "class_path": "lightning.pytorch.loggers.WandbLogger",
                            "init_args": {"project": "mine", "save_dir": "runs"},
                        },
                    ]
                }
            }
        )
    )
    path = write_sweep(tmp_path, configs=[str(REPO / "configs" / "eval" / "quickstart_autoattack.yaml"), str(extra)])
    cell = expand(load_sweep(path))[0]
    loggers = json.loads(cell.argv[-1].split("=", 1)[1])
    assert [entry["init_args"]["save_dir"] for entry in loggers] == [str(cell.dir)] * 2
    assert loggers[0]["init_args"]["name"] == "" and loggers[1]["init_args"] == {
        "project": "mine",
        "save_dir": str(cell.dir),
        "name": cell.id,
    }
    # --wandb adds a WandbLogger where the configs have none
    cell = expand(load_sweep(write_sweep(tmp_path), wandb=True))[0]
    loggers = json.loads(cell.argv[-1].split("=", 1)[1])
    assert [entry["class_path"].rsplit(".", 1)[-1] for entry in loggers] == ["CSVLogger", "WandbLogger"]
    assert loggers[1]["init_args"]["name"] == cell.id and loggers[1]["init_args"]["project"] == "robust-lightning"


def test_dry_run_prints_the_array_script_and_writes_nothing(tmp_path, capsys):
    assert main(["sweep", "--config", str(write_sweep(tmp_path)), "--dry_run"]) == 0
    out = capsys.readouterr().out
    script, _, listing = out.partition("\n# sweep demo:")
    for line in [
        "#SBATCH --job-name=rl-demo",
        "#SBATCH --array=0-7%3",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --signal=SIGUSR1@90",
        "#SBATCH --open-mode=append",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=1",
        f"#SBATCH --output={tmp_path / 'out' / 'logs' / '%A_%a.out'}",
        "module load cuda",
        f"cd {Path.cwd()}",
        'export WANDB_MODE="${WANDB_MODE:-offline}"',
        f'srun --kill-on-bad-exit=1 "$PYTHON" -m robust_lightning cell {tmp_path / "out" / "arrays" / "000.json"} '
        '--index "$SLURM_ARRAY_TASK_ID"',
    ]:
        assert line in script.splitlines(), line
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert " 8 cells, 0 done, 0 in the queue, 8 to run" in listing and listing.count("\n# [") == 8
    assert not (tmp_path / "out").exists()


def fake_slurm(tmp_path: Path, monkeypatch, job: str = "4242") -> Path:
    """sbatch and squeue stand-ins on PATH: sbatch records its arguments and answers ``job``; the queue is empty."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", f'echo "$@" >> {bin_dir}/sbatch.calls\necho "{job};cluster"'), ("squeue", "true")):
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_rerun_submits_only_cells_without_results_nor_a_place_in_the_queue(tmp_path, monkeypatch, capsys):
    bin_dir = fake_slurm(tmp_path, monkeypatch)
    path = write_sweep(tmp_path)
    assert main(["sweep", "--config", str(path)]) == 0
    out_dir = tmp_path / "out"
    manifest = json.loads((out_dir / "arrays" / "000.json").read_text())
    cells = [c["id"] for c in manifest["cells"]]
    assert len(cells) == 8 and (out_dir / "arrays" / "000.sbatch").is_file()
    assert json.loads((out_dir / "submissions.json").read_text()) == [
        {"cells": cells, "job_id": "4242", "manifest": str(out_dir / "arrays" / "000.json")}
    ]
    assert (bin_dir / "sbatch.calls").read_text().split() == ["--parsable", str(out_dir / "arrays" / "000.sbatch")]

    # done, failed, interrupted, running (its job gone) and never-started cells; tasks 6 and 7 still queued
    for i, status in enumerate(["done", "done", "failed", "interrupted", "running"]):
        mark(out_dir / "cells" / cells[i], status)
    (bin_dir / "squeue").write_text("#!/bin/bash\nprintf '4242 6 RUNNING\\n4242 7 PENDING\\n999 0 RUNNING\\n'\n")
    capsys.readouterr()
    assert main(["sweep", "--config", str(path)]) == 0
    assert "8 cells, 2 done, 2 in the queue, 4 to run: submitted" in capsys.readouterr().out
    second = json.loads((out_dir / "arrays" / "001.json").read_text())
    assert [c["id"] for c in second["cells"]] == cells[2:6]
    assert "#SBATCH --array=0-3%3" in (out_dir / "arrays" / "001.sbatch").read_text()
    assert [s["job_id"] for s in json.loads((out_dir / "submissions.json").read_text())] == ["4242", "4242"]
    assert cell_state(out_dir / "cells" / cells[0]) == "done" and cell_state(out_dir / "cells" / "none") == "missing"


@pytest.mark.parametrize("flags", [[], ["--dry_run"], ["--local"]])
def test_a_misspelt_key_stops_the_sweep_before_anything_is_written_or_submitted(tmp_path, monkeypatch, capsys, flags):
    bin_dir = fake_slurm(tmp_path, monkeypatch)
    path = write_sweep(tmp_path, grid={"ckpt_path": {"a": "/weights/a.ckpt"}, "data.imag_size": [32, 48]})
    assert main(["sweep", "--config", str(path), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # not even the dry run's script
    first, *rest = err.strip().splitlines()
    assert (
        first == "robust-lightning: error: sweep cell 0 (ckpt_path=a, data.imag_size=32): unrecognized arguments: "
        "--data.imag_size=32"
    )
    assert rest[0].startswith("did you mean: data.image_size") and len(rest) == 1
    assert not (tmp_path / "out").exists() and not (bin_dir / "sbatch.calls").exists()


def test_a_bad_value_names_its_cell(tmp_path, monkeypatch, capsys):
    bin_dir = fake_slurm(tmp_path, monkeypatch)
    path = write_sweep(tmp_path, grid={"data.image_size": [32, "big"]})
    assert main(["sweep", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith('robust-lightning: error: sweep cell 1 (data.image_size=big): Parser key "data.image_size":')
        and "Got value: big" in err
    )
    assert not (tmp_path / "out").exists() and not (bin_dir / "sbatch.calls").exists()


def test_a_misspelt_key_in_a_bundle_config_names_its_cell(tmp_path, monkeypatch, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"data": {"eval_limt": 8}}))
    path = write_sweep(
        tmp_path, grid={"benchmark": {"clean": {"args": {"trainer.callbacks": []}}, "typo": {"configs": [str(typo)]}}}
    )
    assert main(["sweep", "--config", str(path), "--dry_run"]) == 2
    first, second = capsys.readouterr().err.strip().splitlines()
    assert (
        first == "robust-lightning: error: sweep cell 1 (benchmark=typo): Subcommand 'test' does not accept "
        "option 'data.eval_limt'"
    )
    assert second.startswith("did you mean: data.eval_limit")


def test_sweep_without_sbatch_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no squeue
    assert main(["sweep", "--config", str(write_sweep(tmp_path))]) == 2
    assert "sbatch not found: submit from a SLURM login node, or use --dry_run / --local" in capsys.readouterr().err


def test_slurm_layout_sets_devices_and_nodes_from_the_allocation(monkeypatch):
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    assert slurm_layout() == []
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert slurm_layout() == ["--trainer.devices=4", "--trainer.num_nodes=2"]


def test_task_records_a_failed_cell_with_its_exit_status(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for name in ("SLURM_PROCID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RL_SWEEP_LOG", str(tmp_path / "task.log"))
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: None)  # keep this process's forks as they are
    cell_dir = tmp_path / "cells" / "bad"
    manifest = tmp_path / "manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "sweep": "demo",
                "workdir": str(REPO),
                "log_pattern": "",
                "wandb": None,
                "cells": [
                    {
                        "id": "bad",
                        "labels": {"x": "1"},
                        "values": {"x": 1},
                        "dir": str(cell_dir),
                        "argv": ["validate", "--no_such_option=1"],
                    }
                ],
            }
        )
    )
    assert run_cell(str(manifest), 0, main) == 2
    status = json.loads((cell_dir / "results.json").read_text())["sweep"]
    assert status["status"] == "failed" and status["exit_code"] == 2 and status["cell"] == "bad"
    assert status["log"] == str(tmp_path / "task.log") and status["labels"] == {"x": "1"}
    assert Path.cwd() == REPO  # cells run from the directory the sweep was submitted in

    # a cell stopped by SIGTERM (the command line's exit status 143) is interrupted, not failed or done
    assert run_cell(str(manifest), 0, lambda argv: EXIT_SIGTERM) == EXIT_SIGTERM
    status = json.loads((cell_dir / "results.json").read_text())["sweep"]
    assert status["status"] == "interrupted" and status["exit_code"] == 143


def make_finished_sweep(tmp_path: Path, monkeypatch) -> tuple[Path, list[str]]:
    """A sweep whose cells ran: two done (one with results appended twice), one failed with a SLURM log, one
    never started; and a stray cell of an older grid on disk."""
    out_dir = tmp_path / "out"
    fake_slurm(tmp_path, monkeypatch, job="77")
    path = write_sweep(tmp_path, grid={"data.image_size": [32, 48, 64, 96]})
    assert main(["sweep", "--config", str(path)]) == 0
    cells = [c["id"] for c in json.loads((out_dir / "sweep.json").read_text())["cells"]]
    test = {
        "metrics": {"test/acc1": 0.5, "test/num_images": 16.0},
        "seconds": 2.0,
        "conditions": {"seed": 0, "data": {"image_size": 32}},
        "checkpoint": {"path": "/x", "sha256": "ab"},
    }
    autoattack = {
        "threat_models": {
            "Linf-4_255": {
                "norm": "Linf",
                "eps": 0.0157,
                "num_points": 16,
                "clean_accuracy": 0.5,
                "robust_accuracy": 0.25,
                "robust_accuracy_after": {"apgd-ce": 0.25},
            }
        },
        "conditions": {"version": "apgd-ce"},
    }
    mark(out_dir / "cells" / cells[0], "done", test=test, autoattack=autoattack)
    mark(out_dir / "cells" / cells[1], "done", test=test)
    mark(out_dir / "cells" / cells[1], "done", test={**test, "metrics": {"test/acc1": 0.75, "test/num_images": 16.0}})
    mark(out_dir / "cells" / cells[2], "failed", test=test)
    (out_dir / "logs").mkdir(exist_ok=True)
    (out_dir / "logs" / "77_2.out").write_text("".join(f"line {i}\n" for i in range(40)) + "CUDA out of memory\n")
    mark(out_dir / "cells" / "image_size=128__old", "done", test=test)
    return out_dir, cells


@pytest.mark.parametrize("process_exits", [True, False])
def test_a_cell_stopped_by_sigterm_leaves_sigterm_ignored_where_its_process_exits(tmp_path, monkeypatch, process_exits):
    """`robust-lightning cell` runs the cell's command in its own process, which exits after it. Stopped by SIGTERM,
    that command leaves SIGTERM ignored, as a command line's own command does: a second one (srun's, once another
    task of the array's step has exited) would end the process before it has recorded the cell and exited 143.
    Called from Python (``main(args)``), it gives the earlier handler back. The fit runs in this process, where the
    signal can land in its first step. tiny_config's bar off and no loader workers: the handling checked comes after
    the command, which they do not reach; tests/test_stop_anywhere.py checks it with a user's defaults on 2 ranks."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    for name in ("SLURM_PROCID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: None)  # keep this process's forks as they are
    signal_in_step = {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": 1, "signal_name": "SIGTERM"}}
    overrides = {"model.arch": "test_resnet", "trainer.limit_train_batches": 2, "trainer.callbacks": [signal_in_step]}
    config = tiny_config(tmp_path, **overrides)
    cell = {
        "id": "c",
        "labels": {},
        "values": {},
        "dir": str(tmp_path / "cell"),
        "argv": ["fit", "--config", str(config)],
    }
    manifest = tmp_path / "manifest.json"
    manifest.write_text(
        json.dumps({"sweep": "s", "workdir": str(tmp_path), "log_pattern": "", "wandb": None, "cells": [cell]})
    )
    # SIGTERM's handling where the cell's command ends its W&B run after its stop, where the cell records the stop,
    # and where the cell command ends its own W&B run
    finish, write, seen = cli.finish_wandb_run, ResultsFile.write, []

    def noting(what, call):
        return lambda *a: (seen.append((what, signal.getsignal(signal.SIGTERM))), call(*a))[1]

    monkeypatch.setattr(cli, "finish_wandb_run", noting("finish W&B", finish))
    monkeypatch.setattr(ResultsFile, "write", noting("write results", write))
    # the ranks leave together once, at the end of the cell's command; `cell` then finds no Trainer (nothing to do)
    left_together = []
    monkeypatch.setattr(cli, "leave_together", lambda trainer: left_together.append(trainer))
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["cell", str(manifest), "--index", "0"], process_exits=process_exits) == EXIT_SIGTERM
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert cell_state(tmp_path / "cell") == "interrupted"
    assert [trainer is not None for trainer in left_together] == [True, False]
    expected = signal.SIG_IGN if process_exits else before
    assert seen[-3:] == [("finish W&B", expected), ("write results", expected), ("finish W&B", expected)], seen
    assert after == expected


def test_report_merges_every_cell_once_and_lists_the_missing(tmp_path, monkeypatch, capsys):
    out_dir, cells = make_finished_sweep(tmp_path, monkeypatch)
    assert main(["report", str(out_dir)]) == 0
    report = json.loads((out_dir / "report.json").read_text())
    assert [r["cell"] for r in report["rows"]] == cells  # the stray old cell is not part of this sweep
    assert report["cells"] == 4 and report["done"] == 2
    first, second = report["rows"][:2]
    assert first["data.image_size"] == "32" and first["status"] == "done" and first["test/acc1"] == 0.5
    assert first["autoattack.Linf-4_255.robust_accuracy"] == 0.25 and first["test.seconds"] == 2.0
    assert first["autoattack.Linf-4_255.robust_accuracy_after.apgd-ce"] == 0.25
    assert second["test/acc1"] == 0.75  # the latest results of a retried cell, once
    assert not any("conditions" in c or "sha256" in c or c.endswith(".eps") for c in report["columns"])
    assert report["columns"][:3] == ["data.image_size", "cell", "status"]
    failed, missing = report["missing_or_failed"]
    assert (failed["cell"], failed["state"], failed["reason"]) == (cells[2], "failed", "failed (see the log)")
    assert failed["log"] == str(out_dir / "logs" / "77_2.out")
    assert failed["log_tail"].endswith("CUDA out of memory") and "line 20" not in failed["log_tail"]
    assert "test/acc1" not in report["rows"][2]  # a failed cell's partial results are not reported
    assert (missing["cell"], missing["state"]) == (cells[3], "missing")
    assert missing["log"] is None and missing["log_tail"] == ""  # its task never wrote a log

    markdown = (out_dir / "report.md").read_text()
    assert "2 of 4 cells done." in markdown and "## Missing or failed cells" in markdown
    assert markdown.count("| done |") == 2 and "CUDA out of memory" in markdown
    rows = (out_dir / "report.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("data.image_size,cell,status,")

    before = {p.name: p.read_bytes() for p in out_dir.glob("report.*")}
    assert main(["report", str(out_dir), "--wandb"]) == 0  # W&B disabled in tests: the call is a no-op
    assert {p.name: p.read_bytes() for p in out_dir.glob("report.*")} == before

    assert main(["report", str(out_dir), "--columns", "test/acc1"]) == 0
    assert json.loads((out_dir / "report.json").read_text())["columns"] == [
        "data.image_size",
        "cell",
        "status",
        "test/acc1",
    ]


def test_report_without_sweep_json_reads_the_cells_on_disk(tmp_path, monkeypatch):
    out_dir, cells = make_finished_sweep(tmp_path, monkeypatch)
    (out_dir / "sweep.json").unlink()
    report = report_module.build_report(out_dir)
    assert sorted(r["cell"] for r in report["rows"]) == sorted([*cells[:3], "image_size=128__old"])
    assert main(["report", str(tmp_path / "nowhere")]) == 2


def test_help_lists_sweep_and_report(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "\n  sweep " in out and "\n  report " in out


@pytest.mark.parametrize(
    "name, cells", [("quickstart", 4), ("quickstart_at", 4), ("paper_autoattack", 18), ("paper_benchmarks", 10)]
)
def test_shipped_sweep_files_expand(name, cells, monkeypatch):
    monkeypatch.chdir(REPO)
    sweep = load_sweep(REPO / "configs" / "sweeps" / f"{name}.yaml")
    assert len(expand(sweep)) == cells and sweep.name == name


def test_slurm_templates(tmp_path):
    for template in ("train_multinode.sbatch", "eval_array.sbatch"):
        text = (REPO / "slurm" / template).read_text()
        assert subprocess.run(["bash", "-n", str(REPO / "slurm" / template)]).returncode == 0
        for line in ("#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
            assert line in text.splitlines()
        # Lightning: devices == --ntasks-per-node, num_nodes == --nodes, processes started by srun
        assert '--trainer.devices="$SLURM_NTASKS_PER_NODE"' in text
        assert '--trainer.num_nodes="$SLURM_JOB_NUM_NODES"' in text
        assert 'srun --kill-on-bad-exit=1 "$PYTHON" -m robust_lightning ' in text
        assert "--trainer.default_root_dir=" in text


def test_forked_children_ignore_sigusr1(monkeypatch):
    """SLURM signals every process of a step: DataLoader workers must not run Lightning's requeue or SIGTERM
    handlers (the training process handles both, and its workers end with it)."""
    hooks = []
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: hooks.append(hook))
    shield_forked_children()
    (hook,) = hooks
    pid = os.fork()
    if pid == 0:
        hook["after_in_child"]()
        ignored = signal.getsignal(signal.SIGUSR1) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os._exit(0 if ignored else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    # the parent keeps its handlers
    assert signal.getsignal(signal.SIGUSR1) != signal.SIG_IGN and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN


def test_before_python_3_12_a_fork_first_waits_for_a_thread_that_holds_the_runtime_lock(monkeypatch):
    """CPython gh-112275: a child forked while a gloo thread held the runtime lock hung. sys._current_frames takes
    and releases that lock; the wiring is tested here, its effect measured by benchmarks/fork_race.py."""
    hooks = []
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: hooks.append(hook))
    shield_forked_children()
    (hook,) = hooks
    assert hook.get("before") is (sys._current_frames if sys.version_info < (3, 12) else None)


def test_local_sweep_runs_each_cell_through_the_cell_command(tmp_path, capsys):
    """--local runs `python -m robust_lightning cell MANIFEST --index i` per cell, as the array script does under
    srun: a cell that validates records done with its metrics, a cell that fails (a missing warm start, which the
    sweep's parse cannot see) records failed."""
    config = tmp_path / "validate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "limit_val_batches": 1},
                "model": {"arch": "test_resnet"},
                "data": {
                    "source": {
                        "class_path": "SyntheticSource",
                        "init_args": {
                            "num_classes": 4,
                            "train_per_class": 1,
                            "val_per_class": 1,
                            "image_size": 32,
                            "root": str(tmp_path / "synthetic"),
                        },
                    },
                    "image_size": 32,
                    "batch_size": 4,
                    "num_workers": 0,
                },
            }
        )
    )
    path = write_sweep(
        tmp_path,
        command="validate",
        configs=[str(config)],
        args={},
        grid={"model.init_from": {"none": None, "missing": str(tmp_path / "missing.ckpt")}},
    )
    assert main(["sweep", "--config", str(path), "--local"]) == 1  # one cell failed
    assert "1 of 2 cells succeeded" in capsys.readouterr().out
    cells = sorted((tmp_path / "out" / "cells").iterdir())
    states = {cell.name.split("__")[0]: cell_state(cell) for cell in cells}
    assert states == {"init_from=none": "done", "init_from=missing": "failed"}
    done = json.loads((next(c for c in cells if "=none__" in c.name) / "results.json").read_text())
    assert done["validate"]["metrics"]["val/num_images"] == 4


@pytest.mark.parametrize("signal_name, status", [("SIGTERM", EXIT_SIGTERM), ("SIGINT", 128 + signal.SIGINT)])
def test_a_stopped_local_sweep_waits_for_its_cell_and_the_same_command_finishes(tmp_path, signal_name, status):
    """SIGTERM to a local sweep (``kill``) is passed on to the cell it runs; Ctrl-C (SIGINT to the process group)
    reaches the cell from the terminal. Either way the sweep waits for the cell to stop and record its state,
    starts no other cell and exits with the signal's status, without a traceback. Before, Ctrl-C made the sweep kill
    the cell a quarter of a second later, in the middle of its stop, and SIGTERM ended the sweep at once with the
    cell left running. The same sweep command then runs the cells not done (checked after Ctrl-C)."""
    config = tmp_path / "validate.yaml"
    stop = {
        "class_path": "stop_points.StopLocalSweepAt",
        "init_args": {"marks": str(tmp_path / "marks"), "signal_name": signal_name},
    }
    trainer = {"accelerator": "cpu", "devices": 1, "limit_val_batches": 3, "callbacks": [stop]}
    source = {"num_classes": 4, "train_per_class": 1, "val_per_class": 1, "image_size": 32}
    data = {"source": {"class_path": "SyntheticSource", "init_args": {**source, "root": str(tmp_path / "synthetic")}}}
    data |= {"image_size": 32, "batch_size": 1, "eval_batch_size": 1}
    config.write_text(yaml.safe_dump({"trainer": trainer, "model": {"arch": "test_resnet"}, "data": data}))
    path = write_sweep(tmp_path, command="validate", configs=[str(config)], args={}, grid={"seed_everything": [0, 1]})

    stopped = run_command(["sweep", "--config", str(path), "--local"], cwd=tmp_path, timeout=240)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == status, output[-3000:]
    assert f"sweep stopped by {signal_name} in cell" in output and "Traceback" not in output, output[-3000:]
    states = sorted(cell_state(cell) for cell in (tmp_path / "out" / "cells").iterdir())
    assert states == ["interrupted"], states  # the first cell recorded its stop; the second never started

    if signal_name == "SIGINT":  # the re-run does not depend on the signal: once is enough
        again = run_command(["sweep", "--config", str(path), "--local"], cwd=tmp_path, timeout=240)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        assert [cell_state(cell) for cell in (tmp_path / "out" / "cells").iterdir()] == ["done", "done"]
