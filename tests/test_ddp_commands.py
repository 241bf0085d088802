"""Every command a user runs under DDP, on 2 CPU ranks over gloo, with the defaults a user has: the progress
display on (a tqdm bar on a terminal, printed lines without one), the config's callbacks and logger, loader
workers. Each command has a hard time limit that kills every rank (helpers.run_command): a hang fails the test.

The quickstart's own configs, cut to a few batches and a timm test model so that the whole sequence takes about a
minute on 2 cores: fit (2 epochs, AutoAttack at the end), fit --ckpt_path last, validate, test with an evaluation
config, predict.
"""

import csv
import json
from pathlib import Path

from helpers import REPO, run_command

DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
TINY = ["--model.arch", "test_resnet"]  # a ResNet as the quickstart's, a thousandth of its size
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
LAST = "runs/quickstart/checkpoints/last.ckpt"


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def check(result, command: str) -> str:
    assert result.returncode == 0, f"{command} failed:\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def test_every_command_ends_under_ddp_with_the_defaults_a_user_has(tmp_path):
    # fit on a terminal: the tqdm bar reads the logged values on rank zero only; with a value logged for
    # all-reduction at epoch end, rank zero's bar and the other rank's epoch-end metrics used to wait in different
    # collectives forever
    fit = run_command(
        [
            "fit",
            "--config",
            QUICKSTART,
            *DDP,
            *TINY,
            "--model.init_from",
            "null",
            "--trainer.limit_train_batches",
            "3",
            "--trainer.limit_val_batches",
            "2",
            "--trainer.log_every_n_steps",
            "2",
        ],
        cwd=tmp_path,
        timeout=300,
        terminal=True,
    )
    output = check(fit, "fit")
    assert "Epoch 1: 100%" in output and "AutoAttack Linf-4_255" in output
    run = tmp_path / "runs" / "quickstart" / "version_0"
    fitted = results(run)
    assert f"results: {(run / 'results.json').resolve()}" in output  # the README: fit prints where results went
    assert fitted["fit"]["conditions"]["world_size"] == 2
    assert fitted["fit"]["metrics"]["val/num_images"] == 2 * 2 * 32  # 2 batches of 32 on each rank
    assert fitted["autoattack"]["threat_models"]["Linf-4_255"]["num_points"] == 16

    # resumed in its run directory, without a terminal: printed lines instead of a bar
    resumed = run_command(
        [
            "fit",
            "--config",
            QUICKSTART,
            *DDP,
            *TINY,
            "--model.init_from",
            "null",
            "--trainer.limit_train_batches",
            "3",
            "--trainer.limit_val_batches",
            "2",
            "--trainer.log_every_n_steps",
            "2",
            "--trainer.max_epochs",
            "3",
            "--ckpt_path",
            "last",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    output = check(resumed, "fit --ckpt_path last")
    assert "epoch 2 batch 2/3" in output and "epoch 2 done" in output and "epoch 1 batch" not in output
    assert results(run)["fit"]["epochs"] == 3

    # every validation image once over both ranks
    validate = run_command(
        ["validate", "--config", QUICKSTART, *DDP, *TINY, "--ckpt_path", LAST], cwd=tmp_path, timeout=300
    )
    check(validate, "validate")
    validated = results(tmp_path / "runs" / "quickstart" / "version_1")["validate"]["metrics"]
    assert validated["val/num_images"] == 1000

    # an evaluation config on the checkpoint: AutoAttack, points split over the ranks (one of its three threat
    # models, to keep the suite short)
    test = run_command(
        [
            "test",
            "--config",
            str(REPO / "configs" / "eval" / "quickstart_autoattack.yaml"),
            *DDP,
            "--ckpt_path",
            LAST,
            "--data.eval_limit",
            "10",
            "--trainer.callbacks.init_args.threat_models",
            "[{norm: L2, eps: 0.2857142857142857}]",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    check(test, "test")
    attacked = results(tmp_path / "runs" / "quickstart_autoattack" / "version_0")["autoattack"]["threat_models"]
    assert {name: section["num_points"] for name, section in attacked.items()} == {"L2-0.285714": 10}
    # the outcomes go where the README says: runs/quickstart_autoattack/autoattack/<threat model>/rank<r>.jsonl
    outcomes = tmp_path / "runs" / "quickstart_autoattack" / "autoattack" / "L2-0.285714"
    assert sorted(path.name for path in outcomes.glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]

    predict = run_command(
        ["predict", "--config", QUICKSTART, *DDP, *TINY, "--ckpt_path", LAST, "--data.eval_limit", "30"],
        cwd=tmp_path,
        timeout=300,
    )
    check(predict, "predict")
    rows = [
        row
        for path in sorted((tmp_path / "runs" / "quickstart" / "version_2").glob("predictions-rank*.csv"))
        for row in csv.DictReader(path.open())
    ]
    assert len(rows) == len({row["key"] for row in rows}) == 30
