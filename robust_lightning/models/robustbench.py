"""``robustbench:<name>`` architectures: the ImageNet Linf entries of RobustBench whose architecture timm builds.

``--model.arch robustbench:Singh2023Revisiting_ConvNeXt-T-ConvStem`` resolves to the timm architecture, the
input normaliser and the evaluation preprocessing that RobustBench uses for that entry
(robustbench/model_zoo/imagenet.py, RobustBench/robustbench on GitHub), so a released checkpoint of the entry
loads and is evaluated as the leaderboard did. The table, with the leaderboard's published clean and
AutoAttack accuracies, is data/robustbench_imagenet_linf.csv (provenance in data/PROVENANCE.md). Nothing here
downloads: the weights are a local file (``--model.init_from`` or ``robust_lightning.load_model``).

Entries RobustBench builds from its own code (XCiT registrations, RaWideResNet, MeanSparse, MixedNUTS, MIMIR)
are not listed: timm does not build them.
"""

from __future__ import annotations

import csv
import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from robust_lightning.errors import UserError
from robust_lightning.paths import DATA_DIR

if TYPE_CHECKING:
    import torch
    from PIL import Image

__all__ = [
    "PREFIX",
    "Preprocessing",
    "RobustBenchEntry",
    "is_robustbench_arch",
    "preprocessing_mismatch",
    "resolve_arch",
    "robustbench_entries",
    "robustbench_entry",
]

PREFIX = "robustbench:"
TABLE = DATA_DIR / "robustbench_imagenet_linf.csv"
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # robustbench/model_zoo/imagenet.py: mu, sigma
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Preprocessing:
    """One of RobustBench's test transforms (robustbench/data.py PREPROCESSINGS), PIL image -> [0, 1] tensor.

    ``resize``: an int resizes the shorter side, a (h, w) pair resizes to exactly that size, None keeps the
    image as is; ``crop``: centre crop side (None: no crop).
    """

    name: str
    resize: int | tuple[int, int] | None
    crop: int | None
    interpolation: str

    @property
    def image_size(self) -> int:
        """The side of the images the model sees."""
        if self.crop is not None:
            return self.crop
        assert self.resize is not None, f"{self.name} keeps the image's own size"  # every entry resizes or crops
        return self.resize if isinstance(self.resize, int) else self.resize[0]

    def transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """The torchvision transform: PIL image -> float tensor in [0, 1]."""
        from torchvision import transforms as T

        steps = []
        if self.resize is not None:
            steps.append(T.Resize(self.resize, interpolation=T.InterpolationMode(self.interpolation)))
        if self.crop is not None:
            steps.append(T.CenterCrop(self.crop))
        transform: Callable[[Image.Image], torch.Tensor] = T.Compose([*steps, T.ToTensor()])
        return transform

    def describe(self) -> str:
        parts = []
        if self.resize is not None:
            size = self.resize if isinstance(self.resize, int) else "x".join(map(str, self.resize))
            parts.append(f"resize {size} {self.interpolation}")
        if self.crop is not None:
            parts.append(f"centre crop {self.crop}")
        return ", ".join(parts) or "none"


PREPROCESSINGS = {
    p.name: p
    for p in (
        Preprocessing("Res256Crop224", 256, 224, "bilinear"),
        Preprocessing("BicubicRes256Crop224", 256, 224, "bicubic"),
        Preprocessing("Crop288", None, 288, "bilinear"),  # no resize: the centre 288 px of the original image
        Preprocessing("Res224", (224, 224), None, "bilinear"),
    )
}


@dataclass(frozen=True)
class RobustBenchEntry:
    name: str
    timm_arch: str
    mean: tuple[float, float, float] | None  # None: the model takes [0, 1] input as is
    std: tuple[float, float, float] | None
    preprocessing: Preprocessing
    clean_acc: float  # published by the leaderboard, % on its 5000 ImageNet val images
    autoattack_acc: float  # AutoAttack standard, Linf eps below, %
    eps: str
    architecture: str
    venue: str

    @property
    def arch(self) -> str:
        return PREFIX + self.name


@cache
def robustbench_entries() -> dict[str, RobustBenchEntry]:
    """Every entry of data/robustbench_imagenet_linf.csv by RobustBench name."""
    entries = {}
    with open(TABLE, newline="") as f:
        for row in csv.DictReader(f):
            normalized = row["normalization"] == "imagenet"
            entries[row["name"]] = RobustBenchEntry(
                name=row["name"],
                timm_arch=row["timm_arch"],
                mean=IMAGENET_MEAN if normalized else None,
                std=IMAGENET_STD if normalized else None,
                preprocessing=PREPROCESSINGS[row["preprocessing"]],
                clean_acc=float(row["clean_acc"]),
                autoattack_acc=float(row["autoattack_acc"]),
                eps=row["eps"],
                architecture=row["architecture"],
                venue=row["venue"],
            )
    return entries


def is_robustbench_arch(arch: str) -> bool:
    return arch.startswith(PREFIX)


def robustbench_entry(arch: str) -> RobustBenchEntry:
    """The entry of ``robustbench:<name>`` (or of a bare name); a UserError names the known ones."""
    name = arch[len(PREFIX) :] if is_robustbench_arch(arch) else arch
    entries = robustbench_entries()
    if name not in entries:
        close = difflib.get_close_matches(name, list(entries), n=3, cutoff=0.5)
        hint = f" Did you mean: {', '.join(PREFIX + c for c in close)}?" if close else ""
        raise UserError(
            f"unknown RobustBench model {name!r}: expected one of the ImageNet Linf entries timm builds "
            f"({', '.join(entries)}; see data/robustbench_imagenet_linf.csv).{hint}"
        )
    return entries[name]


def resolve_arch(
    arch: str, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> tuple[str, Sequence[float] | None, Sequence[float] | None]:
    """(timm architecture, mean, std) for ``arch``: a ``robustbench:`` name gives its entry's architecture and
    normaliser (an explicit mean/std wins); any other name is returned unchanged."""
    if not is_robustbench_arch(arch):
        return arch, mean, std
    entry = robustbench_entry(arch)
    if mean is None and std is None:
        mean, std = entry.mean, entry.std
    return entry.timm_arch, mean, std


def preprocessing_mismatch(arch: str, image_size: int, crop_pct: float, interpolation: str = "bicubic") -> str | None:
    """Why evaluating ``arch`` with the data module's preprocessing (resize the shorter side to
    floor(image_size / crop_pct), ``interpolation``, centre crop image_size) differs from RobustBench's for
    that entry; None when it is the same."""
    prep = robustbench_entry(arch).preprocessing
    ours = Preprocessing("data", math.floor(image_size / crop_pct), image_size, interpolation)
    if (prep.resize, prep.crop, prep.interpolation) == (ours.resize, ours.crop, ours.interpolation):
        return None
    return (
        f"{arch} was evaluated by RobustBench with preprocessing {prep.name} ({prep.describe()}); the data "
        f"module uses {ours.describe()} (data.image_size {image_size}, data.crop_pct {crop_pct}), so accuracies "
        "may differ slightly from the leaderboard's"
    )
