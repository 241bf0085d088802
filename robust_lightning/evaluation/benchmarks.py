"""Distribution-shift benchmarks as a Lightning callback:
``robust-lightning test --config configs/eval/benchmarks.yaml --ckpt_path CKPT``.

Protocols (the papers and reference code of each benchmark; class lists in data/, see data/PROVENANCE.md):

- ImageNet-R, ImageNet-A: 200 classes each. The 1000 logits are sliced to the 200 classes before the argmax;
  labels are positions in the sorted 200 wnids. Top-1 and ECE (15 equal-width bins, on the softmax over the
  200 sliced logits), and the RMS calibration error Hendrycks et al. publish for them (adaptive bins of 100,
  ``calibration.rms_calibration_error``).
- ImageNet-Sketch, ImageNet-V2: 1000 classes, folders named by wnid or (V2's release) by class index 0..999.
  Top-1 and ECE (softmax over the 1000 logits).
- ImageNet-O: OOD detection of its 2000 images (positive class) against the ImageNet val images of the same
  200 classes; anomaly score = -max softmax over the 200 sliced logits. AUPR (average precision) and AUROC,
  computed exactly (ties as in scikit-learn), and FPR at 95% TPR at the threshold the reference code picks
  (``fpr_and_fdr_at_recall`` in the calibration_tools.py of hendrycks/natural-adv-examples: the recall closest to
  95%, not the first one at or above it).
- ImageNet-9 (backgrounds challenge): original, mixed_same and mixed_rand; the 1000-way argmax is mapped to the
  9 classes by data/in_to_in9.json (an unmapped prediction is wrong). Accuracy and ECE per variant and
  BG-gap = mixed_same - mixed_rand. Its images are 224 x 224 already: only resized at another model resolution.

Each benchmark is one entry of ``SHIFT_BENCHMARKS`` (its layout, class subset, metrics and card column), from
which this callback, the robustness card and ``robust_lightning.evaluate`` take their lists of benchmarks.

Preprocessing: the project's eval transform (resize floor(r / crop_pct) bicubic, centre crop r) for all but
ImageNet-9; images reach the model in [0, 1].

Everything runs in ``on_test_end``, after the test loop (and its metrics) are done, so the model's own test set
is evaluated as usual and the benchmarks never mix into its metrics. Layouts are checked in ``on_test_start``,
before any work, so a wrong path fails at once. Under DDP each dataset is split over the ranks without padding
and the per-image results are gathered exactly (every image counts once). A benchmark whose root is not set is
reported as skipped, with the reason, in results.json.
"""

import json
import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from robust_lightning.data.classes import class_map
from robust_lightning.data.transforms import ImageTransform, eval_resize_size, eval_transform
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import Evaluation, evaluating, evaluation_resolution
from robust_lightning.evaluation.calibration import (
    ECE_BINS,
    RMS_BIN_SIZE,
    expected_calibration_error,
    rms_calibration_error,
)
from robust_lightning.evaluation.prediction import (  # noqa: F401 (predict)
    ExactSize,
    Predictions,
    Split,
    predict,
    predict_split,
    rows_folder,
    samples_digest,
)
from robust_lightning.evaluation.results import weights_sha256
from robust_lightning.paths import DATA_DIR

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
IN9_VARIANTS = ("original", "mixed_same", "mixed_rand")
# Class folders of the released IN-9 data, in class order (data/PROVENANCE.md; the names come from the release
# tarballs, not from in9_classes.txt, which lists display names and WordNet superclasses in the same order)
IN9_FOLDERS = (
    "00_dog",
    "01_bird",
    "02_wheeled vehicle",
    "03_reptile",
    "04_carnivore",
    "05_insect",
    "06_musical instrument",
    "07_primate",
    "08_fish",
)


# ----------------------------------------------------------------------------------------------- class lists
def _lines(name: str) -> list[str]:
    return [line.strip() for line in (DATA_DIR / name).read_text().splitlines() if line.strip()]


@cache
def subset_classes(benchmark: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(sorted 200 wnids, their 1000-class logit indices) of "imagenet_r", "imagenet_a" or "imagenet_o"."""
    wnids, indices = _lines(f"{benchmark}_wnids.txt"), [int(i) for i in _lines(f"{benchmark}_indices_in_1k.txt")]
    assert len(wnids) == len(indices) == 200 and wnids == sorted(wnids), f"data/{benchmark}_*.txt are inconsistent"
    return tuple(wnids), tuple(indices)


@cache
def in9_map() -> torch.Tensor:
    """1000-class index -> IN-9 class (-1: no IN-9 class)."""
    mapping = json.loads((DATA_DIR / "in_to_in9.json").read_text())
    assert len(_lines("in9_classes.txt")) == len(IN9_FOLDERS)
    return torch.tensor([mapping[str(i)] for i in range(1000)])


def choose(names: str | list[str], standard: tuple[str, ...], every: tuple[str, ...], what: str) -> list[str]:
    """A config's selection: "standard", "all", one name or a list, checked against ``every``, in its order."""
    chosen = list(
        standard if names == "standard" else every if names == "all" else [names] if isinstance(names, str) else names
    )
    unknown = [name for name in chosen if name not in every]
    if unknown or not chosen:
        raise UserError(f"{what}: unknown {unknown}; use 'standard', 'all' or names among {', '.join(every)}")
    return [name for name in every if name in chosen]


# ---------------------------------------------------------------------------------------------------- metrics
def accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    return (predictions == targets).double().mean().item()


def ood_metrics(scores: torch.Tensor, is_ood: torch.Tensor) -> dict[str, float]:
    """AUPR (average precision), AUROC and FPR at 95% TPR with OOD the positive class and higher score = more
    anomalous. Exact: tied scores form one threshold, as in sklearn's average_precision_score / roc_curve.
    (torchmetrics' functional versions compute in float32 and pass scores outside [0, 1] through a sigmoid.)"""
    scores, positive = scores.double(), is_ood.bool()
    if positive.all() or not positive.any():
        raise ValueError("OOD metrics need both in-distribution and OOD images")
    order = torch.argsort(scores, descending=True, stable=True)
    scores, positive = scores[order], positive[order].double()
    # the last position of each group of tied scores: one threshold per distinct score
    last = torch.cat([torch.nonzero(scores[1:] != scores[:-1]).flatten(), torch.tensor([len(scores) - 1])])
    tps = positive.cumsum(0)[last]
    fps = (last + 1).double() - tps
    tpr, fpr = tps / tps[-1], fps / fps[-1]
    precision = tps / (tps + fps)
    zero = torch.zeros(1, dtype=torch.float64)
    recall_steps = torch.diff(tpr, prepend=zero)  # AP = sum over thresholds of (R_k - R_k-1) P_k
    tpr0, fpr0 = torch.cat([zero, tpr]), torch.cat([zero, fpr])  # the ROC curve starts at (0, 0)
    return {
        "aupr": (recall_steps * precision).sum().item(),
        "auroc": torch.trapezoid(tpr0, fpr0).item(),
        "fpr95": fpr[recall_threshold(tpr, 0.95)].item(),
    }


def recall_threshold(tpr: torch.Tensor, recall: float) -> int:
    """The threshold whose recall (TPR) is closest to ``recall``, as hendrycks/natural-adv-examples'
    fpr_and_fdr_at_recall picks it: among the thresholds up to the first that reaches full recall, searched from
    the lowest threshold up, so of tied ones the lowest threshold wins."""
    full = int(torch.searchsorted(tpr, tpr[-1]))  # the first threshold with every OOD image caught
    distance = (tpr[: full + 1] - recall).abs().flip(0)
    return full - int(torch.argmin(distance))  # argmin returns the first minimum: the lowest threshold's


def bg_gap(accuracies: dict[str, float]) -> float:
    return accuracies["mixed_same"] - accuracies["mixed_rand"]


# ---------------------------------------------------------------------------------------------------- layouts
def _class_folders(root: Path, expected: str) -> list[Path]:
    if not root.is_dir():
        raise UserError(f"{root} does not exist; expected {expected}")
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise UserError(f"{root} has no class folders; expected {expected}")
    return folders


def _check_known(root: Path, folders: list[Path], known: Container[str], expected: str) -> None:
    unknown = [f.name for f in folders if f.name not in known]
    if unknown:
        raise UserError(
            f"{root}: unknown class folders {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; expected {expected}"
        )


def _images(folder: Path, label: int) -> list[tuple[str, int]]:
    return [(str(p), label) for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]


def _samples(root: Path, folders: list[Path], label_of: dict[str, int], expected: str) -> list[tuple[str, int]]:
    samples = [s for folder in folders for s in _images(folder, label_of[folder.name])]
    if not samples:
        raise UserError(f"{root} holds no images; expected {expected}")
    return samples


def subset_split(benchmark: str, root: str | Path) -> Split:
    """ImageNet-R / -A / -O: ``root/<wnid>/*`` with wnids among the benchmark's 200 (missing ones allowed, so a
    partial copy runs; a folder of another class is an error)."""
    root, (wnids, _) = Path(root), subset_classes(benchmark)
    expected = f"{root}/<wnid>/<images> with the 200 {benchmark} wnids of data/{benchmark}_wnids.txt as folder names"
    folders = _class_folders(root, expected)
    label_of = {wnid: i for i, wnid in enumerate(wnids)}
    _check_known(root, folders, label_of, expected)
    return Split(benchmark, _samples(root, folders, label_of, expected))


def full_split(benchmark: str, root: str | Path) -> Split:
    """ImageNet-Sketch / -V2: ``root/<wnid>/*``, or ``root/<class index 0..999>/*`` (V2's released layout)."""
    root = Path(root)
    expected = (
        f"{root}/<class folder>/<images>, class folders named by ImageNet wnid (n01440764, ...) or all by "
        "class index (0 ... 999)"
    )
    folders = _class_folders(root, expected)
    label_of = class_map("imagenet")
    if all(f.name.isdigit() for f in folders):
        label_of = {str(i): i for i in range(1000)}
    _check_known(root, folders, label_of, expected)
    return Split(benchmark, _samples(root, folders, label_of, expected))


def imagenet_o_splits(root: str | Path, val_root: str | Path | None) -> tuple[Split, Split]:
    """(OOD ImageNet-O images, in-distribution ImageNet val images of the same 200 classes), both labelled 1 for
    OOD, 0 for in-distribution."""
    ood = subset_split("imagenet_o", root)
    if val_root is None:
        raise UserError(
            "ImageNet-O needs imagenet_val: the ImageNet val folder <val>/<wnid>/<images> whose images "
            "of the 200 ImageNet-O classes are the in-distribution set"
        )
    val_root, (wnids, _) = Path(val_root), subset_classes("imagenet_o")
    expected = f"{val_root}/<wnid>/<images>, the ImageNet val folder (its ImageNet-O classes are used)"
    folders = [f for f in _class_folders(val_root, expected) if f.name in set(wnids)]
    samples = [(path, 0) for folder in folders for path, _ in _images(folder, 0)]
    if not samples:
        raise UserError(f"{val_root} holds no images of the 200 ImageNet-O classes; expected {expected}")
    return Split("imagenet_o", [(path, 1) for path, _ in ood.samples]), Split("imagenet_val", samples)


def in9_splits(root: str | Path) -> list[Split]:
    """ImageNet-9: ``root/{original,mixed_same,mixed_rand}/val/<class folder>/*`` (folders 00_dog ... 08_fish)."""
    root, splits = Path(root), []
    for variant in IN9_VARIANTS:
        expected = (
            f"{root}/{{{','.join(IN9_VARIANTS)}}}/val/<class folder>/<images> with the class folders "
            f"{', '.join(repr(f) for f in IN9_FOLDERS)}"
        )
        path = root / variant / "val"
        folders = _class_folders(path, expected)
        label_of = {name: i for i, name in enumerate(IN9_FOLDERS)}
        _check_known(path, folders, label_of, expected)
        splits.append(Split(variant, _samples(path, folders, label_of, expected)))
    return splits


# --------------------------------------------------------------------------------------------- the metrics
def top1_metrics(predictions: dict[str, Predictions], num_classes: int) -> dict[str, Any]:
    """Top-1 and ECE of one split (softmax over the logits of the benchmark's classes)."""
    (p,) = predictions.values()
    return {
        "num_images": len(p.label),
        "num_classes": num_classes,
        "acc1": accuracy(p.prediction, p.label),
        "ece": expected_calibration_error(p.confidence, p.prediction == p.label),
    }


def top1_rms_metrics(predictions: dict[str, Predictions], num_classes: int) -> dict[str, Any]:
    """Top-1 and ECE, and the RMS calibration error Hendrycks et al. publish for ImageNet-R and -A."""
    section = top1_metrics(predictions, num_classes)
    (p,) = predictions.values()
    rms = rms_calibration_error(p.confidence, p.prediction == p.label)
    section["rms_calibration_error"] = None if math.isnan(rms) else rms  # None: under 2 bins of images
    return section


def imagenet_o_metrics(predictions: dict[str, Predictions], num_classes: int) -> dict[str, Any]:
    """AUPR, AUROC and FPR@95TPR of the OOD images (the first split) against the in-distribution ones."""
    ood, known = predictions.values()
    is_ood = torch.cat([ood.label, known.label]).bool()  # labels: 1 = OOD, 0 = in-distribution
    anomaly = -torch.cat([ood.confidence, known.confidence])  # -max softmax over the 200 classes
    return {"num_ood": len(ood.label), "num_in_distribution": len(known.label), **ood_metrics(anomaly, is_ood)}


def imagenet_9_metrics(predictions: dict[str, Predictions], num_classes: int) -> dict[str, Any]:
    """Accuracy and ECE per variant through the 1000 -> 9 map, and the BG-gap."""
    to_in9 = in9_map()
    variants = {}
    for variant, p in predictions.items():
        correct = to_in9[p.prediction] == p.label
        # confidence: the max of the 1000-way softmax, whose argmax gave the (mapped) prediction
        variants[variant] = {
            "num_images": len(p.label),
            "acc1": correct.double().mean().item(),
            "ece": expected_calibration_error(p.confidence, correct),
        }
    return {"variants": variants, "bg_gap": bg_gap({k: v["acc1"] for k, v in variants.items()})}


# -------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class ShiftBenchmark:
    """One distribution-shift benchmark, as the callback, the card, ``robust_lightning.evaluate`` and the docs
    know it.

    ``name`` is its dataset root's name (in the card's ``datasets``, ``evaluate``'s evaluations and datasets) and
    its section of results.json. ``splits`` checks the layout under its root, and under the roots that ``needs``
    names, and lists the images of each split: ``splits(root, *needed_roots)``. ``classes`` gives the 1000-class
    logit indices of its class subset (None: all 1000). ``metrics`` turns the predictions of its splits, by split
    name, into its section: ``metrics(predictions, num_classes)``. ``keys`` are the section's scalar metrics,
    logged as ``benchmarks/<name>/<key>`` (a section with ``variants`` logs each variant's acc1 and ECE too);
    those with "ece" are in the card's calibration table. ``column`` and ``headline`` are its cell in the card's
    distribution-shift row. ``as_released``: its images keep their released size (resized only at another
    resolution), without the eval transform's resize and crop."""

    name: str
    splits: Callable[..., list[Split]]
    metrics: Callable[[dict[str, Predictions], int], dict[str, Any]]
    keys: tuple[str, ...]
    column: str
    headline: str = "acc1"
    classes: Callable[[], tuple[int, ...]] | None = None
    needs: tuple[str, ...] = ()
    as_released: bool = False


def subset_indices(benchmark: str) -> tuple[int, ...]:
    return subset_classes(benchmark)[1]


def _one(layout: Callable[[str, str | Path], Split], benchmark: str) -> Callable[[str | Path], list[Split]]:
    return lambda root: [layout(benchmark, root)]


# Every distribution-shift benchmark, in the order of results.json, the card's row and the docs. A benchmark added
# here (or by a test, with monkeypatch.setitem) is run by the callback, the card and evaluate under its name.
SHIFT_BENCHMARKS: dict[str, ShiftBenchmark] = {
    b.name: b
    for b in (
        ShiftBenchmark(
            "imagenet_r",
            _one(subset_split, "imagenet_r"),
            top1_rms_metrics,
            keys=("acc1", "ece", "rms_calibration_error"),
            column="IN-R",
            classes=partial(subset_indices, "imagenet_r"),
        ),
        ShiftBenchmark(
            "imagenet_a",
            _one(subset_split, "imagenet_a"),
            top1_rms_metrics,
            keys=("acc1", "ece", "rms_calibration_error"),
            column="IN-A",
            classes=partial(subset_indices, "imagenet_a"),
        ),
        ShiftBenchmark(
            "imagenet_sketch",
            _one(full_split, "imagenet_sketch"),
            top1_metrics,
            keys=("acc1", "ece"),
            column="IN-Sketch",
        ),
        ShiftBenchmark(
            "imagenet_v2", _one(full_split, "imagenet_v2"), top1_metrics, keys=("acc1", "ece"), column="IN-V2"
        ),
        ShiftBenchmark(
            "imagenet_o",
            lambda root, val_root: list(imagenet_o_splits(root, val_root)),
            imagenet_o_metrics,
            keys=("aupr", "auroc", "fpr95"),
            column="IN-O AUPR",
            headline="aupr",
            classes=partial(subset_indices, "imagenet_o"),
            needs=("imagenet_val",),
        ),
        ShiftBenchmark(
            "imagenet_9",
            in9_splits,
            imagenet_9_metrics,
            keys=("bg_gap",),
            column="IN-9 BG-gap ↓",
            headline="bg_gap",
            as_released=True,
        ),
    )
}


def shift_datasets() -> list[str]:
    """The dataset roots the registered benchmarks read: each benchmark's, then those it needs."""
    names = [name for b in SHIFT_BENCHMARKS.values() for name in (b.name, *b.needs)]
    return list(dict.fromkeys(names))


class DistributionShiftBenchmarks(Evaluation):
    """The benchmarks of ``SHIFT_BENCHMARKS`` after ``test``: ImageNet-R, -A, -Sketch, -V2, -O and ImageNet-9 (see
    the module docstring).

    Args:
        imagenet_r, imagenet_a: roots ``<root>/<wnid>/*`` (200 classes; a partial copy with fewer is accepted).
        imagenet_sketch: root ``<root>/<wnid>/*``.
        imagenet_v2: root ``<root>/<class index>/*`` (the release) or ``<root>/<wnid>/*``.
        imagenet_o: root ``<root>/<wnid>/*`` of the OOD images; needs ``imagenet_val``.
        imagenet_val: the ImageNet val folder ``<root>/<wnid>/*`` (in-distribution images for ImageNet-O).
        imagenet_9: root ``<root>/{original,mixed_same,mixed_rand}/val/<class folder>/*``.
            A root left at None skips that benchmark (listed under "skipped" in results.json).
        roots: the roots by name, for any benchmark of ``SHIFT_BENCHMARKS`` (the arguments above are the same
            for those of the project).
        image_size: evaluation resolution (default: the model's ``image_size``, else the data's, else 224).
        crop_pct: the eval transform resizes the shorter side to floor(image_size / crop_pct) before the crop.
        batch_size: images per forward pass on each device.
        num_workers: decoding processes per device.
    """

    name = "benchmarks"

    def __init__(
        self,
        imagenet_r: str | None = None,
        imagenet_a: str | None = None,
        imagenet_sketch: str | None = None,
        imagenet_v2: str | None = None,
        imagenet_o: str | None = None,
        imagenet_val: str | None = None,
        imagenet_9: str | None = None,
        image_size: int | None = None,
        crop_pct: float = 0.875,
        batch_size: int = 64,
        num_workers: int = 4,
        roots: dict[str, str | None] | None = None,
    ):
        # the arguments of configs written before ``roots``: they stay, as the same roots
        arguments = {
            "imagenet_r": imagenet_r,
            "imagenet_a": imagenet_a,
            "imagenet_sketch": imagenet_sketch,
            "imagenet_v2": imagenet_v2,
            "imagenet_o": imagenet_o,
            "imagenet_val": imagenet_val,
            "imagenet_9": imagenet_9,
        }
        self.benchmarks = dict(SHIFT_BENCHMARKS)  # as registered now: a later registration changes no callback
        known = shift_datasets()
        roots = dict(roots or {})
        unknown = sorted(set(roots) - set(known))
        twice = sorted(name for name, root in arguments.items() if root is not None and roots.get(name) is not None)
        if unknown or twice:
            raise UserError(
                f"DistributionShiftBenchmarks.roots: {f'unknown {unknown}' if unknown else f'{twice} given twice'}; "
                f"the roots are {', '.join(known)}"
            )
        given = {**{k: v for k, v in arguments.items() if v is not None}, **roots}
        self.roots = {name: given.get(name) for name in known}
        self.arguments = set(arguments)
        self.image_size, self.crop_pct = image_size, crop_pct
        self.batch_size, self.num_workers = batch_size, num_workers
        self.splits: dict[str, list[Split]] = {}
        self.skipped: list[dict[str, str]] = []

    # ------------------------------------------------------------------------------------------- set-up
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check every layout before any work: one wrong path fails the run at once, not hours in."""
        self.splits, self.skipped = {}, []
        for name, benchmark in self.benchmarks.items():
            root = self.roots[name]
            if root is None:
                argument = name if name in self.arguments else f"roots.{name}"
                self.skipped.append({"benchmark": name, "reason": f"no root given (init arg {argument})"})
            else:
                self.splits[name] = benchmark.splits(root, *(self.roots[need] for need in benchmark.needs))
        self.resolution = evaluation_resolution(trainer, pl_module, self.image_size)

    def _preprocessing(self, benchmark: ShiftBenchmark) -> tuple[ImageTransform, str]:
        r = self.resolution
        if benchmark.as_released:
            note = "none (224 x 224 as released)" if r == 224 else f"resize to {r} x {r} (bicubic)"
            return ExactSize(r), note
        note = f"resize shorter side to {eval_resize_size(r, self.crop_pct)} (bicubic), centre crop {r}"
        return eval_transform(r, self.crop_pct), note

    # ------------------------------------------------------------------------------------------ running
    def _predict(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        split: Split,
        transform: ImageTransform,
        note: str,
        classes: tuple[int, ...] | None,
        weights_hash: str,
    ) -> Predictions:
        """``note``: the preprocessing as results.json names it, which the prediction folder's identity records."""
        settings = {"images": samples_digest(split.samples), "preprocessing": note, "classes": classes}
        return predict_split(
            trainer,
            pl_module,
            split,
            transform,
            classes,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            records=rows_folder(trainer, split.name, weights_hash, settings),
        )

    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, weights_hash: str) -> dict[str, Any]:
        benchmark = self.benchmarks[name]
        transform, note = self._preprocessing(benchmark)
        classes = benchmark.classes() if benchmark.classes is not None else None
        predictions = {
            split.name: self._predict(trainer, pl_module, split, transform, note, classes, weights_hash)
            for split in self.splits[name]
        }
        given = {key: str(Path(root).resolve()) for key in (name, *benchmark.needs) if (root := self.roots[key])}
        section: dict[str, Any] = {
            "root": given.pop(name),  # only the benchmarks given a root run
            "preprocessing": note,
            **given,  # the roots it needs (ImageNet-O's in-distribution images)
            **benchmark.metrics(predictions, len(classes or range(1000))),
        }
        section["corrupt_images"] = [image for p in predictions.values() for image in p.corrupt]
        return section

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights_hash = weights_sha256(pl_module)  # once: it reads every weight
        with evaluating(pl_module):
            sections = {name: self._run(trainer, pl_module, name, weights_hash) for name in self.splits}
        metrics = flat_metrics(sections, self.benchmarks)
        # one table: benchmark, metric (e.g. mixed_rand/acc1)
        rows = [key.removeprefix("benchmarks/").split("/", 1) + [value] for key, value in metrics.items()]
        shown = ", ".join(f"{k.removeprefix('benchmarks/')}={v:.4f}" for k, v in metrics.items())
        self.publish(
            trainer,
            {
                **sections,
                "skipped": self.skipped,
                "conditions": {
                    "image_size": self.resolution,
                    "crop_pct": self.crop_pct,
                    "ece_bins": ECE_BINS,
                    "rms_calibration_bin_size": RMS_BIN_SIZE,
                    "checkpoint": trainer.ckpt_path,
                },
            },
            metrics,
            tables={"summary": (["benchmark", "metric", "value"], rows)},
            message=f"benchmarks: {shown or 'none run'}; skipped: {[s['benchmark'] for s in self.skipped]}",
        )


def flat_metrics(sections: dict[str, dict[str, Any]], benchmarks: dict[str, ShiftBenchmark]) -> dict[str, float]:
    """The scalar metrics of the results sections as ``benchmarks/<name>/<metric>`` logger keys."""
    metrics = {}
    for name, section in sections.items():
        for key in benchmarks[name].keys:
            if section.get(key) is not None:
                metrics[f"benchmarks/{name}/{key}"] = float(section[key])
        for variant, values in section.get("variants", {}).items():
            metrics[f"benchmarks/{name}/{variant}/acc1"] = float(values["acc1"])
            metrics[f"benchmarks/{name}/{variant}/ece"] = float(values["ece"])
    return metrics
