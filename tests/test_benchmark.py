"""robust_lightning.benchmark: RobustBench's ``benchmark()`` call, run as the project's standard AutoAttack on
RobustBench's ImageNet subset. On a folder holding the subset's first two images and a model whose answer on each
is known in advance: one image robust, the other broken within eps, so (clean, robust) = (1, 0.5)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import robust_lightning
from robust_lightning.data.classes import class_map
from robust_lightning.errors import UserError
from robust_lightning.paths import DATA_DIR

EPS = 4 / 255


def subset_images(root, count: int) -> list[tuple[str, int]]:
    """The first ``count`` images of RobustBench's list as uniform grey JPEGs (300x400) under root/val/, the first
    bright (0.9), the others just below mid-grey (0.49, closer to 0.5 than eps). Returns (wnid, grey level)."""
    lines = (DATA_DIR / "robustbench_imagenet_test_image_ids.txt").read_text().split()[:count]
    made = []
    for i, line in enumerate(lines):
        level = 230 if i == 0 else 125
        path = root / "val" / line
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((300, 400, 3), level, np.uint8)).save(path, quality=100)
        made.append((line.split("/")[0], level))
    return made


class Brightness(nn.Module):
    """Class ``bright`` where an image's mean is above 0.5, class ``dark`` below: a margin of 200 x |mean - 0.5|.

    Each class scores -100 x (mean - centre)^2: 1 for bright, 0 for dark, 2 and beyond for the others. A model that
    only scaled one direction by (mean - 0.5) would leave AutoAttack's targeted DLR loss, a ratio of logit
    differences, constant: its zero gradients would call for Square from scratch, which this test is not about."""

    def __init__(self, bright: int, dark: int):
        super().__init__()
        centres = 2 + torch.arange(1000) / 1000
        centres[bright], centres[dark] = 1.0, 0.0
        self.register_buffer("centres", centres)

    def forward(self, x):
        return -100 * (x.mean((1, 2, 3))[:, None] - self.centres) ** 2


def test_benchmark_takes_robustbenchs_call_and_returns_clean_and_robust_accuracy(tmp_path, monkeypatch, capsys):
    (bright, _), (dark, _) = subset_images(tmp_path / "imagenet", 2)
    classes = class_map("imagenet")
    model = Brightness(classes[bright], classes[dark]).eval()
    monkeypatch.chdir(tmp_path)  # to_disk writes model_info/ into the working directory, as RobustBench
    clean, robust = robust_lightning.benchmark(
        model,
        n_examples=2,
        dataset="imagenet",
        threat_model="Linf",
        to_disk=True,
        model_name="Me2026Bright",
        data_dir=str(tmp_path / "imagenet"),
        batch_size=2,
        eps=EPS,
    )
    # the bright image is far from 0.5: robust; the dark one is 0.01 below it, within eps: broken
    assert (clean, robust) == (1.0, 0.5)
    out = capsys.readouterr().out
    assert "Clean accuracy: 100.00%" in out and "Adversarial accuracy: 50.00%" in out
    info = json.loads((tmp_path / "model_info" / "imagenet" / "Linf" / "Me2026Bright.json").read_text())
    assert info == {"dataset": "imagenet", "eps": EPS, "clean_acc": "100.0", "autoattack_acc": "50.0"}
    assert not (tmp_path / "autoattack").exists()  # no outcomes in the working directory


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dataset": "cifar10"}, "dataset='imagenet', got 'cifar10'"),
        ({"threat_model": "corruptions"}, "threat_model must be 'Linf' or 'L2'"),
        ({"eps": None}, "`eps` must be specified"),
        ({"n_examples": 10_000}, "n_examples must be in 1..5000"),
        ({"preprocessing": "Res256Crop224"}, "'Res256Crop224' is not available"),
        ({"to_disk": True}, "`model_name` should be specified"),
    ],
)
def test_benchmark_refuses_what_it_cannot_run_with_robustbenchs_own_words(tmp_path, changes, message):
    call = {"n_examples": 2, "dataset": "imagenet", "threat_model": "Linf", "data_dir": str(tmp_path), "eps": EPS}
    with pytest.raises(UserError, match=message):
        robust_lightning.benchmark(Brightness(0, 1), **{**call, **changes})
