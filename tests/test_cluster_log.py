"""What a cluster's log shows of a fit: the training losses are means over the whole global batch (the same on one
process and on two ranks that train the same batches), the throughput of the whole job beside that of a device, and
a word on BatchNorm's statistics under DDP."""

import csv
import json
from pathlib import Path

import pytest

from helpers import WNIDS, folder_source, make_image_tree, run_command, tiny_config


def fit(tmp_path: Path, devices: int, arch: str) -> tuple[Path, str]:
    """Three steps of 8 of the same square images on any number of ranks, without random draws: a crop of the whole
    image (scale 1: no other box fits a square), no flip, an attack without random start."""
    tmp_path.mkdir()
    make_image_tree(tmp_path / "imagenet" / "train", {w: 8 for w in WNIDS})
    make_image_tree(tmp_path / "imagenet" / "val", {w: 1 for w in WNIDS})
    options = {
        "data.source": folder_source(tmp_path / "imagenet"),
        "data.crop_scale": [1.0, 1.0],
        "trainer.max_steps": 3,
        "trainer.log_every_n_steps": 1,
        "data.global_batch_size": 8,
        "data.num_workers": 1,
        "model.arch": arch,
        "model.attack": "apgd",
        "model.attack_steps": 1,
    }
    if devices > 1:
        options.update({"trainer.devices": devices, "trainer.strategy": "ddp"})
    config = tiny_config(tmp_path, **options)
    result = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "runs" / "tiny" / "version_0", result.stdout + result.stderr


def logged(run: Path, key: str) -> dict[int, float]:
    with open(run / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def test_two_ranks_log_the_losses_and_throughput_of_the_whole_job(tmp_path):
    one, _ = fit(tmp_path / "one", 1, "test_convnext")
    two, output = fit(tmp_path / "two", 2, "test_convnext")
    for key in ("train/loss", "train/clean_loss", "train/adv_loss"):
        expected, got = logged(one, key), logged(two, key)
        assert sorted(got) == sorted(expected) == [0, 1, 2]
        # the same 8 images a step, split 4 + 4 or not at all: the same mean, to the rounding by which the two runs'
        # weights drift apart (rank zero's share alone differs by several per cent)
        assert got == pytest.approx(expected, rel=1e-3), key
    throughput = json.loads((two / "results.json").read_text())["fit"]["throughput"]
    assert throughput["job_images_per_s"] == pytest.approx(2 * throughput["images_per_s"], abs=2e-4)  # 4 decimals
    assert "perf/job_images_per_s" in (two / "metrics.csv").read_text().splitlines()[0]
    assert "BatchNorm" not in output  # ConvNeXt has none


def test_a_batchnorm_model_under_ddp_says_how_to_sync_its_statistics(tmp_path):
    _, output = fit(tmp_path / "bn", 2, "test_resnet")
    assert "test_resnet has BatchNorm: each rank normalises with the statistics of its own share" in output
    assert output.count("--trainer.sync_batchnorm true") == 1  # rank zero only
