"""ImageNet-C (Hendrycks & Dietterich) as a Lightning callback:
``robust-lightning test --config configs/eval/imagenet_c.yaml --ckpt_path CKPT``.

Protocol (Hendrycks & Dietterich, ICLR 2019, and hendrycks/robustness; constants in data/, see data/PROVENANCE.md):

- Released layout ``<root>/<corruption>/<severity 1..5>/<wnid>/*.JPEG``, or the same under the group folders
  ``<root>/{noise,blur,weather,digital,extra}/<corruption>/...``; each corruption is found wherever it is.
- The images are 224 x 224 already (resize 256, crop 224, corrupt, JPEG q85): they are only decoded, never
  resized and centre-cropped again. Only a model at another resolution gets them resized (bicubic) to it.
- Labels: wnid folders through the ImageNet class map; 1000-way top-1 per corruption x severity, and ECE per
  corruption over its evaluated severities pooled (the sibling's helpers, 15 bins).
- CE_c = sum_s err_{s,c} / sum_s err^AlexNet_{s,c} (per-severity AlexNet errors of the 15 standard corruptions;
  for the 4 extra ones only the 5-severity mean is published, so their CE needs all 5 severities).
  Relative CE_c = sum_s (err_{s,c} - err_clean) / sum_s (err^AlexNet_{s,c} - err^AlexNet_clean).
  mCE / relative mCE = mean over the 15 standard corruptions, reported as such only when all 15 x 5 cells are
  evaluated on all 50,000 ImageNet val images (the set the AlexNet errors were measured on); otherwise as
  ``mce_partial`` / ``relative_mce_partial`` with the corruptions, severities and images used (e.g. a quick
  look with max_images, or generated corruptions of the RobustBench 5000 or of data.eval_limit images).

Like DistributionShiftBenchmarks: the layout is checked in ``on_test_start`` (a wrong root fails before any
work), everything runs in ``on_test_end`` after the model's own test set, and under DDP the images are split
over the ranks and gathered exactly by ``prediction.predict_split``.

With ``source: generated`` (configs/eval/imagenet_c_generated.yaml) the corruptions are made on the fly from
the datamodule's evaluation images (e.g. the RobustBench 5000-image subset) at any resolution, as the release was
made (eval resize and centre crop, corruption by robust_lightning.evaluation.corruptions, JPEG quality 85); the
metrics are the same code, and the results.json section says how the images were made (``source``,
``generated``).
"""

import csv
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import IterableDataset

from robust_lightning.atomic import atomic_write_json
from robust_lightning.console import tqdm
from robust_lightning.data.classes import class_map
from robust_lightning.data.contract import EvaluationSource, evaluation_data
from robust_lightning.data.transforms import eval_resize_size
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import (
    Evaluation,
    evaluating,
    evaluation_resolution,
    evaluation_source,
    gather_objects,
    new_figure,
    to_model_input,
    until_stopped,
)
from robust_lightning.evaluation.benchmarks import IMAGE_SUFFIXES, accuracy, choose
from robust_lightning.evaluation.calibration import ECE_BINS, expected_calibration_error
from robust_lightning.evaluation.corruptions import (
    CORRUPTIONS,
    MIN_SIZE,
    RELEASED_JPEG_QUALITY,
    CorruptedEvalTransform,
    frost_directory,
)
from robust_lightning.evaluation.prediction import ExactSize, Split, predict, predict_split, rows_folder, samples_digest
from robust_lightning.evaluation.results import weights_sha256
from robust_lightning.paths import DATA_DIR

STANDARD = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)
EXTRA = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
ALL = STANDARD + EXTRA
assert tuple(CORRUPTIONS) == ALL, "corruptions.py and imagenet_c.py list the corruptions differently"
GROUPS = ("noise", "blur", "weather", "digital", "extra")
# the paper's groups (the 4 extra corruptions are the held-out validation set)
GROUP_OF = {
    c: group
    for group, names in zip(GROUPS, (STANDARD[:3], STANDARD[3:7], STANDARD[7:11], STANDARD[11:], EXTRA))
    for c in names
}
SEVERITIES = (1, 2, 3, 4, 5)
RELEASED_SIZE = 224
IMAGENET_VAL_IMAGES = 50_000  # in every released cell: all of ImageNet val
ALL_IMAGES = f"all {IMAGENET_VAL_IMAGES} ImageNet val images in every cell"
# AlexNet's clean top-1 error: torchvision's pretrained AlexNet (acc@1 56.522%, the model the ImageNet-C paper
# evaluates; its Table 1 rounds the error to 43.5%). Not in data/: an init arg overrides it.
ALEXNET_CLEAN_ERROR = 0.43478
ALEXNET_CLEAN_SOURCE = "torchvision alexnet IMAGENET1K_V1 acc@1 56.522% (paper: 43.5% clean error)"
ALEXNET_ON_RELEASED = (
    "the AlexNet errors were measured on the released ImageNet-C (all 50,000 val images, 224 px, "
    "the original generation code): on a subset of the images or at another resolution the CE, "
    "mCE and their relative versions are approximations, and even on all of val at 224 px the "
    "generated images are not the released ones (other random draws, today's JPEG encoder, the "
    "numpy motion blur instead of ImageMagick's)"
)
IMPLEMENTATION = (
    "robust_lightning.evaluation.corruptions (numpy / OpenCV / scikit-image, in the loader workers): "
    "the per-severity parameters of Hendrycks' make_imagenet_c.py; motion blur (motion_blur, snow) as "
    "the imagecorruptions numpy port of ImageMagick's"
)

EXPECTED = (
    f"<root>/<corruption>/<severity 1..5>/<wnid>/*.JPEG (the released ImageNet-C layout), optionally "
    f"under group folders <root>/{{{','.join(GROUPS)}}}/<corruption>/<severity>/<wnid>/*.JPEG; "
    f"corruptions: {', '.join(ALL)}; wnids: the ImageNet-1k class folders (n01440764 ...)"
)


# -------------------------------------------------------------------------------------------- AlexNet tables
@cache
def alexnet_errors_per_severity() -> dict[str, tuple[float, ...]]:
    """AlexNet top-1 error per severity 1..5 of the 15 standard corruptions (fractions)."""
    with open(DATA_DIR / "imagenet_c_alexnet_err_per_severity.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    table = {row["corruption"]: tuple(float(row[f"sev{s}"]) for s in SEVERITIES) for row in rows}
    for row in rows:  # the file's own check: its mean column is the mean of the 5 severities
        assert abs(sum(table[row["corruption"]]) / 5 - float(row["mean"])) < 1e-9, row
    assert tuple(table) == STANDARD, "data/imagenet_c_alexnet_err_per_severity.csv: unexpected corruptions"
    return table


@cache
def alexnet_mean_errors() -> dict[str, float]:
    """AlexNet top-1 error averaged over severities 1..5, all 19 corruptions (the 4 extra to 4 decimals)."""
    with open(DATA_DIR / "imagenet_c_alexnet_baselines.csv", newline="") as f:
        table = {row["corruption"]: float(row["alexnet_err"]) for row in csv.DictReader(f)}
    assert tuple(table) == ALL, "data/imagenet_c_alexnet_baselines.csv: unexpected corruptions"
    return table


def _alexnet_sum(corruption: str, severities: list[int]) -> float | None:
    """sum_s err^AlexNet_{s,c} over ``severities``; None where the data cannot give it (an extra corruption
    evaluated on fewer than 5 severities: only its mean is published)."""
    if corruption in STANDARD:
        return sum(alexnet_errors_per_severity()[corruption][s - 1] for s in severities)
    if sorted(severities) == list(SEVERITIES):
        return 5 * alexnet_mean_errors()[corruption]
    return None


# --------------------------------------------------------------------------------------------------- metrics
def corruption_errors(
    errors: dict[str, dict[int, float]],
    clean_error: float | None = None,
    alexnet_clean_error: float = ALEXNET_CLEAN_ERROR,
    fewer_images: str | None = None,
) -> dict[str, Any]:
    """CE, relative CE, mCE and relative mCE from top-1 errors ``errors[corruption][severity]`` (fractions).
    ``fewer_images``: None when every cell held all 50,000 ImageNet val images, else what the images were instead
    (``images_short_of_the_benchmark``).

    Returns {"ce": {c: CE or None}, "relative_ce": {c: ... or None}} plus "mce" and "relative_mce" when every
    standard corruption has all 5 severities on all the images, else "mce_partial" / "relative_mce_partial" =
    {"value", "corruptions", "severities", "images"} over the standard corruptions evaluated (None when there are
    none). Relative values need ``clean_error`` (else None)."""
    ce, relative = {}, {}
    for corruption, by_severity in errors.items():
        severities = sorted(by_severity)
        alexnet = _alexnet_sum(corruption, severities)
        ours = sum(by_severity.values())
        ce[corruption] = None if alexnet is None else ours / alexnet
        relative[corruption] = (
            None
            if alexnet is None or clean_error is None
            else (ours - len(severities) * clean_error) / (alexnet - len(severities) * alexnet_clean_error)
        )
    standard = [c for c in STANDARD if c in errors]
    result: dict[str, Any] = {"ce": ce, "relative_ce": relative}
    complete = (
        len(standard) == len(STANDARD)
        and all(sorted(errors[c]) == list(SEVERITIES) for c in standard)
        and fewer_images is None
    )

    def mean(values: dict[str, float | None]) -> float | None:
        picked = [values[c] for c in standard]
        known = [v for v in picked if v is not None]
        return None if not picked or len(known) < len(picked) else sum(known) / len(known)

    if complete:
        result.update(mce=mean(ce), relative_mce=mean(relative))
    else:  # a different key, so a partial number is never mistaken for the benchmark's mCE
        severities = sorted({s for c in standard for s in errors[c]})
        for key, values in (("mce_partial", ce), ("relative_mce_partial", relative)):
            result[key] = {
                "value": mean(values),
                "corruptions": standard,
                "severities": severities,
                "images": fewer_images or ALL_IMAGES,
            }
    return result


def images_short_of_the_benchmark(per_cell: int, imagenet_val: bool = True) -> str | None:
    """What the images were instead of the benchmark's (all 50,000 ImageNet val images in every cell), or None
    when they were those: ``per_cell`` images in the smallest cell, of ImageNet val or not. By the count, so that
    every selection (limit_per_class, max_images, data.eval_subset, data.eval_limit) that leaves out images says
    so, and one that leaves none out does not."""
    if not imagenet_val:
        return f"{per_cell} images per cell, not of ImageNet val"
    if per_cell < IMAGENET_VAL_IMAGES:
        return f"{per_cell} of the {IMAGENET_VAL_IMAGES} ImageNet val images in the smallest cell"
    return None


# ---------------------------------------------------------------------------------------------------- layout
def _subfolders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir())


def find_corruptions(root: str | Path) -> dict[str, tuple[Path, str | None]]:
    """corruption -> (its folder, its group folder or None) for every corruption folder under ``root``, at the
    top level or inside a group folder."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"ImageNet-C root {root} does not exist; expected {EXPECTED}")
    found: dict[str, list[tuple[Path, str | None]]] = {}
    for folder in _subfolders(root):
        if folder.name in ALL:
            found.setdefault(folder.name, []).append((folder, None))
        elif folder.name in GROUPS:
            for inner in _subfolders(folder):
                if inner.name in ALL:
                    found.setdefault(inner.name, []).append((inner, folder.name))
    if not found:
        raise UserError(f"ImageNet-C root {root} holds no corruption folders; expected {EXPECTED}")
    twice = {c: [str(p) for p, _ in places] for c, places in found.items() if len(places) > 1}
    if twice:
        raise UserError(
            f"ImageNet-C root {root}: corruptions found in more than one place {twice}; expected each once, {EXPECTED}"
        )
    return {c: places[0] for c, places in found.items()}


def _subsample(
    samples: list[tuple[str, int]], limit_per_class: int | None, max_images: int | None
) -> list[tuple[str, int]]:
    """Deterministic: the first ``limit_per_class`` files (sorted) of each class, then ``max_images`` evenly
    spaced over what is left. Every cell holds the same file names, so all cells keep the same images."""
    if limit_per_class is not None:
        kept: list[tuple[str, int]] = []
        counts: dict[int, int] = {}
        for path, label in samples:
            counts[label] = counts.get(label, 0) + 1
            if counts[label] <= limit_per_class:
                kept.append((path, label))
        samples = kept
    if max_images is not None and len(samples) > max_images:
        samples = [samples[i * len(samples) // max_images] for i in range(max_images)]
    return samples


def imagenet_c_cells(
    root: str | Path,
    corruptions: list[str],
    severities: list[int],
    limit_per_class: int | None = None,
    max_images: int | None = None,
) -> tuple[dict[tuple[str, int], list[tuple[str, int]]], dict[str, str | None]]:
    """The images of every requested (corruption, severity) cell as (path, ImageNet label), and each
    corruption's group folder (None at the top level). Raises UserError on any layout problem."""
    found = find_corruptions(root)
    missing = [c for c in corruptions if c not in found]
    if missing:
        raise UserError(
            f"ImageNet-C root {root}: requested corruptions {missing} not found (found "
            f"{sorted(found)}); expected {EXPECTED}"
        )
    label_of = class_map("imagenet")
    cells: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for corruption in corruptions:
        folder = found[corruption][0]
        names = [p.name for p in _subfolders(folder)]
        if not names or any(n not in {str(s) for s in SEVERITIES} for n in names):
            raise UserError(f"{folder}: severity folders {names} are not among 1..5; expected {EXPECTED}")
        for severity in severities:
            cell = folder / str(severity)
            if not cell.is_dir():
                raise UserError(f"{folder}: severity folder {severity} is missing; expected {EXPECTED}")
            wnids = _subfolders(cell)
            unknown = [w.name for w in wnids if w.name not in label_of]
            if not wnids or unknown:
                what = f"unknown wnid folders {unknown[:5]}" if unknown else "no wnid folders"
                raise UserError(f"{cell}: {what}; expected {EXPECTED}")
            samples = [
                (str(p), label_of[w.name])
                for w in wnids
                for p in sorted(w.iterdir())
                if p.suffix.lower() in IMAGE_SUFFIXES
            ]
            if not samples:
                raise UserError(f"{cell} holds no images; expected {EXPECTED}")
            cells[corruption, severity] = _subsample(samples, limit_per_class, max_images)
    return cells, {c: found[c][1] for c in corruptions}


def imagenet_val_test_set(source: EvaluationSource | None) -> str | None:
    """A description of the data module's test set when it is ImageNet val (1000 ImageNet classes from a folder
    or shards, not a held-out train split), else None."""
    if source is None or not source.imagenet_val:
        return None
    subset = [f"{k}={v}" for k, v in (("eval_subset", source.subset), ("eval_limit", source.limit)) if v]
    return f"ImageNet val ({source.location}{'; ' + ', '.join(subset) if subset else ''})"


# -------------------------------------------------------------------------------------------------- callback
class ImageNetC(Evaluation):
    """ImageNet-C top-1, error, CE / mCE, relative CE / mCE and ECE after ``test`` (see the module docstring),
    on the released images (``source: released``, the default, with ``root``) or on corruptions generated on
    the fly from the data module's evaluation images (``source: generated``).

    Generated: each evaluation image (e.g. data.eval_subset robustbench, the RobustBench 5000) goes through the
    release's preprocessing at resolution r (bilinear resize of the shorter side to floor(r / crop_pct), centre
    crop r: torchvision's Resize(256), CenterCrop(224) at r = 224), the corruption
    (robust_lightning.evaluation.corruptions, Hendrycks' parameters) and a JPEG round trip at quality 85 (as released).
    The random draws of an image come from (seed, corruption, severity, a digest of its clean pixels), so they do not
    depend on workers, ranks or batch size. The corruptions are made in the data loader workers, all severities of a
    corruption from one decode of the image; under DDP each rank makes and evaluates its share and the results are
    gathered exactly. results.json records how the images were made, and that the AlexNet errors behind CE / mCE come
    from the released set (all of val at 224 px): on a subset, or at another resolution, CE and mCE are approximations.

    Args:
        root: the released ImageNet-C folder (flat or with group folders; see ``EXPECTED``); source released only.
        source: "released" (the images under ``root``) or "generated" (made from the data module's evaluation
            images; needs robust_lightning's ImageNetDataModule).
        corruptions: "standard" (the 15 of mCE, default), "all" (the 15 + the 4 extra) or a list of names.
        severities: severities to evaluate (default 1..5). mCE proper needs the 15 standard at all 5.
        clean_error: the model's clean top-1 error for the relative CE. None: 1 - ``test/acc1`` of this run's
            own test loop when the datamodule's test set is ImageNet val (results.json says which was used);
            otherwise relative values are None.
        alexnet_clean_error: AlexNet's clean top-1 error (the relative CE's baseline).
        limit_per_class: released only: evaluate only the first n images (sorted by file name) of each class in
            each cell.
        max_images: released only: evaluate only n images per cell, evenly spaced over the (class-sorted) list:
            a quick, class-balanced look (e.g. 1000 = one image of each class). Both: subsampled results are
            labelled in results.json and are not comparable with published numbers. (Generated: subsample
            with data.eval_subset / data.eval_limit.)
        seed: generated only: base seed of the corruptions' random draws (a non-negative integer).
        crop_pct: generated only: the eval resize is floor(r / crop_pct) (0.875: 256 for 224, as the release).
        frost_dir: generated only: folder of the frost textures frost1.png ... frost5.jpg (default:
            data/imagenet_c_frost, shipped with this repository).
        image_size: evaluation resolution (default: the model's ``image_size``, else the data's, else 224).
            Released images are resized (bicubic, to image_size x image_size) only when it is not their size;
            generated ones are made at it (at least 32).
        batch_size: images per forward pass on each device (generated: batch_size // len(severities) source
            images, each at every severity).
        num_workers: decoding (and generating) processes per device; None: data.num_workers, else 4.
        plot: save a bar plot of the error per corruption (imagenet_c_errors.png beside results.json).
    """

    name = "imagenet_c"
    plot_file = "imagenet_c_errors.png"
    plot_key = "errors"

    def __init__(
        self,
        root: str | None = None,
        source: str = "released",
        corruptions: str | list[str] = "standard",
        severities: list[int] = list(SEVERITIES),  # noqa: B006 - a default --print_config shows; read, never mutated
        clean_error: float | None = None,
        alexnet_clean_error: float = ALEXNET_CLEAN_ERROR,
        limit_per_class: int | None = None,
        max_images: int | None = None,
        seed: int = 0,
        crop_pct: float = 0.875,
        frost_dir: str | None = None,
        image_size: int | None = None,
        batch_size: int = 64,
        num_workers: int | None = None,
        plot: bool = True,
    ):
        if source not in ("released", "generated"):
            raise UserError(f"ImageNetC source must be 'released' (with root) or 'generated', got {source!r}")
        if source == "released" and root is None:
            raise UserError(
                f"ImageNetC needs root, the released ImageNet-C folder: {EXPECTED}; or source: generated "
                "to make the corruptions from the evaluation images"
            )
        if source == "generated" and root is not None:
            raise UserError(
                "ImageNetC root is the released ImageNet-C folder; with source: generated the corruptions "
                "are made from the data module's evaluation images: leave root out"
            )
        corruptions = choose(corruptions, STANDARD, ALL, "ImageNetC corruptions")
        bad = [s for s in severities if s not in SEVERITIES]
        if bad or not severities:
            raise UserError(f"ImageNetC severities must be among 1..5, got {list(severities)}")
        for name, value in (("limit_per_class", limit_per_class), ("max_images", max_images)):
            if value is not None and value < 1:
                raise UserError(f"ImageNetC {name} must be a positive number of images, got {value}")
            if value is not None and source == "generated":
                raise UserError(
                    f"ImageNetC {name} is for the released set; with source: generated choose the "
                    "images with data.eval_subset / data.eval_limit"
                )
        if clean_error is not None and not 0 <= clean_error <= 1:
            raise UserError(f"ImageNetC clean_error is a fraction in [0, 1], got {clean_error}")
        if not isinstance(seed, int) or seed < 0:
            raise UserError(f"ImageNetC seed must be a non-negative integer, got {seed!r}")
        if not 0 < crop_pct <= 1:
            raise UserError(f"ImageNetC crop_pct must be in (0, 1], got {crop_pct}")
        if batch_size < 1:
            raise UserError(f"ImageNetC batch_size must be a positive number of images, got {batch_size}")
        self.root, self.source = root, source
        self.corruptions = corruptions
        self.severities = sorted(set(severities))
        self.clean_error, self.alexnet_clean_error = clean_error, alexnet_clean_error
        self.limit_per_class, self.max_images = limit_per_class, max_images
        self.seed, self.crop_pct, self.frost_dir = seed, crop_pct, frost_dir
        self.image_size, self.batch_size, self.num_workers, self.plot = image_size, batch_size, num_workers, plot

    def on_test_start(self, trainer, pl_module) -> None:
        """Check everything that can be checked before any work: a wrong root (or missing frost textures) fails
        the run at once, not hours in."""
        self.resolution = evaluation_resolution(trainer, pl_module, self.image_size)
        if self.source == "released":
            assert self.root is not None  # the released source has a root (__init__)
            self.cells, self.groups = imagenet_c_cells(
                self.root, self.corruptions, self.severities, self.limit_per_class, self.max_images
            )
            return
        if evaluation_data(trainer) is None:
            raise UserError(
                "ImageNetC source: generated makes the corruptions from the evaluation images of the data "
                "module: it needs robust_lightning's ImageNetDataModule (the data: section of the config)"
            )
        if self.resolution < MIN_SIZE:
            raise UserError(
                f"ImageNetC source: generated needs a resolution of at least {MIN_SIZE} px, got {self.resolution}"
            )
        self.textures = str(frost_directory(self.frost_dir)) if "frost" in self.corruptions else None

    def _workers(self, trainer) -> int:
        data = evaluation_data(trainer)
        return self.num_workers if self.num_workers is not None else data.num_workers if data is not None else 4

    def on_test_end(self, trainer, pl_module) -> None:
        evaluate = self._released if self.source == "released" else self._generated
        with evaluating(pl_module):
            section = evaluate(trainer, pl_module)  # every rank takes part; None on all but global rank zero
        if section is None:
            self.publish(trainer, None, None)  # the other ranks: the run directory is agreed over all of them
            return
        figure = self._plot(section) if self.plot else None
        if figure is None:
            section["plot"] = "not requested"
        per = section["corruptions"]
        # tables: one W&B panel compares the runs of a sweep cell by cell
        tables = {
            "per_severity": (
                ["corruption", "severity", "acc1", "error"],
                [[c, int(s), v["acc1"][s], v["error"][s]] for c, v in per.items() for s in v["acc1"]],
            ),
            "per_corruption": (
                ["corruption", "mean_acc1", "mean_error", "ce", "relative_ce", "ece"],
                [[c, v["mean_acc1"], v["mean_error"], v["ce"], v["relative_ce"], v["ece"]] for c, v in per.items()],
            ),
        }
        mce = section.get("mce", (section.get("mce_partial") or {}).get("value"))
        self.publish(
            trainer,
            section,
            flat_metrics(section),
            figure,
            tables,
            f"imagenet_c ({self.source}): mean acc1 {section['mean_acc1']:.4f}, "
            f"{'mCE' if 'mce' in section else 'partial mCE'} {mce}",
        )

    # ----------------------------------------------------------------------------------------- released
    def _released(self, trainer, pl_module) -> dict[str, Any] | None:
        # one dataset over every cell: one loader, one gather; cell_of maps each image back to its cell
        keys = list(self.cells)
        samples = [s for key in keys for s in self.cells[key]]
        cell_of = torch.tensor([k for k, key in enumerate(keys) for _ in self.cells[key]])
        settings = {"images": samples_digest(samples), "image_size": self.resolution}
        predictions = predict_split(
            trainer,
            pl_module,
            Split("imagenet_c", samples),
            ExactSize(self.resolution),
            None,
            batch_size=self.batch_size,
            num_workers=self._workers(trainer),
            records=rows_folder(trainer, "imagenet_c", weights_sha256(pl_module), settings),
        )
        cell_of = cell_of[predictions.index]  # unreadable images are skipped (and named in the results)
        if not trainer.is_global_zero:
            return None
        per_cell = int(torch.bincount(cell_of, minlength=len(keys)).min())
        with Image.open(self.cells[keys[0]][0][0]) as image:
            released = image.size
        r = self.resolution
        subsampled = self.limit_per_class is not None or self.max_images is not None
        assert self.root is not None  # the released source has a root (__init__)
        return {
            "source": "released",
            "root": str(Path(self.root).resolve()),
            "layout": "group folders" if any(self.groups.values()) else "flat",
            **self._metrics(
                trainer,
                keys,
                cell_of,
                predictions.label,
                predictions.prediction,
                predictions.confidence,
                self.groups,
                images_short_of_the_benchmark(per_cell),
            ),
            "preprocessing": (
                "none (decoded as released)"
                if released == (r, r)
                else f"resize {released[0]} x {released[1]} to {r} x {r} (bicubic)"
            ),
            "conditions": {
                "image_size": r,
                "released_image_size": list(released),
                "ece_bins": ECE_BINS,
                "subsampled": subsampled,
                "limit_per_class": self.limit_per_class,
                "max_images": self.max_images,
                "checkpoint": trainer.ckpt_path,
            },
            "corrupt_images": predictions.corrupt,
        }

    # ---------------------------------------------------------------------------------------- generated
    @torch.no_grad()
    def _predict_generated(self, trainer, pl_module, corruption: str) -> tuple[list[Any], list[str], int | None]:
        """(key, label, predictions per severity, confidences per severity) of this rank's readable images, the
        unreadable ones, and how many images the evaluation set holds (None where unknown)."""
        transform = CorruptedEvalTransform(
            corruption, self.severities, self.resolution, self.seed, self.crop_pct, self.textures
        )
        loader = self.eval_loader(trainer, transform, max(1, self.batch_size // len(self.severities)), self.num_workers)
        rows: list[Any] = []
        corrupt: list[Any] = []
        bar = tqdm(loader, desc=f"imagenet_c {corruption}", disable=not trainer.is_global_zero, leave=False)
        for batch in until_stopped(bar):
            corrupt += batch["corrupt"]
            if not len(batch["label"]):
                continue
            images = batch["image"]  # B x S x 3 x r x r uint8: every severity of each image
            with trainer.precision_plugin.test_step_context():
                prediction, confidence = predict(pl_module(to_model_input(images.flatten(0, 1), pl_module.device)))
            shape = images.shape[:2]
            rows += zip(
                batch["key"], batch["label"].tolist(), prediction.view(shape).tolist(), confidence.view(shape).tolist()
            )
        return rows, corrupt, _known_size(loader.dataset)

    def _corruption_rows(self, trainer, pl_module, corruption: str, folder: Path | None) -> dict[str, Any]:
        """Every rank's rows of one corruption ({"rows", "corrupt", "expected"}), as saved in ``folder`` by an
        earlier run (rank zero writes them once gathered) or predicted now. Every rank reads the file before the
        gather after which rank zero writes it, so the ranks agree on which corruptions they predict."""
        saved = folder / f"{corruption}.json" if folder is not None else None
        if saved is not None and saved.is_file():
            return dict(json.loads(saved.read_text()))
        rows, corrupt, expected = self._predict_generated(trainer, pl_module, corruption)
        parts = gather_objects((rows, corrupt))
        gathered = {
            "rows": sorted(row for part in parts for row in part[0]),
            "corrupt": sorted(reason for part in parts for reason in part[1]),
            "expected": expected,
        }
        if saved is not None and trainer.is_global_zero:
            atomic_write_json(saved, gathered)
        return gathered

    def _generated(self, trainer, pl_module) -> dict[str, Any] | None:
        source = evaluation_source(trainer)
        settings = {
            "images": source.location if source else None,
            "subset": source.subset if source else None,
            "limit": source.limit if source else None,
            "corruptions_implementation": IMPLEMENTATION,
            **{name: getattr(self, name) for name in ("severities", "seed", "resolution", "crop_pct", "textures")},
        }
        # a corruption's rows are kept once predicted, where the images have a location to tell them apart: a
        # stopped run goes on with the corruptions left
        folder = None
        if source is not None and source.location is not None:
            folder = rows_folder(trainer, "imagenet_c_generated", weights_sha256(pl_module), settings)
        per = {c: self._corruption_rows(trainer, pl_module, c, folder) for c in self.corruptions}
        if not trainer.is_global_zero:
            return None
        rows = {c: per[c]["rows"] for c in self.corruptions}
        corrupt = sorted({reason for c in self.corruptions for reason in per[c]["corrupt"]})
        counts = {len(per[c]["rows"]) + len(per[c]["corrupt"]) for c in self.corruptions}
        expected = per[self.corruptions[0]]["expected"]
        assert len(counts) == 1 and expected in (None, *counts), "images lost or counted twice across ranks"
        keys = [(c, s) for c in self.corruptions for s in self.severities]
        cell_of, target, prediction, confidence = [], [], [], []
        for c_index, c in enumerate(self.corruptions):
            for _, label, predicted, confident in rows[c]:
                for s_index in range(len(self.severities)):
                    cell_of.append(c_index * len(self.severities) + s_index)
                    target.append(label)
                    prediction.append(predicted[s_index])
                    confidence.append(confident[s_index])
        source, num_source_images = evaluation_source(trainer), len(rows[self.corruptions[0]])
        fewer = images_short_of_the_benchmark(num_source_images, source is not None and source.imagenet_val)
        metrics = self._metrics(
            trainer,
            keys,
            torch.tensor(cell_of, dtype=torch.long),
            torch.tensor(target, dtype=torch.long),
            torch.tensor(prediction, dtype=torch.long),
            torch.tensor(confidence, dtype=torch.double),
            GROUP_OF,
            fewer,
        )
        metrics["alexnet"]["note"] = ALEXNET_ON_RELEASED
        r = self.resolution
        data = imagenet_val_test_set(source) or (
            f"data.source {source.kind if source else '?'} evaluation split (not ImageNet val: CE / mCE are not "
            "comparable with AlexNet's)"
        )
        return {
            "source": "generated",
            "generated": {
                "from": data,
                "num_source_images": num_source_images,
                "seed": self.seed,
                "resolution": r,
                "pipeline": f"resize shorter side to {eval_resize_size(r, self.crop_pct)} (bilinear, as the release), "
                f"centre crop {r}, corrupt, JPEG quality {RELEASED_JPEG_QUALITY} round trip (Pillow)",
                "implementation": IMPLEMENTATION,
                "per_image_seed": "numpy SeedSequence(seed, corruption index, severity, blake2b digest of the "
                "image's clean preprocessed pixels) -> MT19937",
                "frost_textures": self.textures,
            },
            **metrics,
            "preprocessing": "generated at the evaluation resolution (see generated.pipeline)",
            "conditions": {
                "image_size": r,
                "crop_pct": self.crop_pct,
                "ece_bins": ECE_BINS,
                "checkpoint": trainer.ckpt_path,
            },
            "corrupt_images": corrupt,
        }

    # ------------------------------------------------------------------------------------------ metrics
    def _clean_error(self, trainer) -> tuple[float | None, str]:
        if self.clean_error is not None:
            return self.clean_error, "init arg clean_error"
        test_set = imagenet_val_test_set(evaluation_source(trainer))
        acc1 = trainer.callback_metrics.get("test/acc1")
        if test_set and acc1 is not None:
            return 1 - float(acc1), f"1 - test/acc1 of this run's test loop on {test_set}"
        return None, "none: set clean_error, or test on ImageNet val in the same run"

    def _metrics(
        self,
        trainer,
        keys: list[tuple[str, int]],
        cell_of: torch.Tensor,
        target: torch.Tensor,
        prediction: torch.Tensor,
        confidence: torch.Tensor,
        groups: Mapping[str, str | None],
        fewer_images: str | None,
    ) -> dict[str, Any]:
        """Top-1 and error per cell, per-corruption means, ECE (severities pooled), CE / mCE and their relative
        versions, for both sources. ``cell_of[i]``: the index in ``keys`` of the (corruption, severity) cell of
        prediction i; ``fewer_images``: see ``corruption_errors``."""
        correct = prediction == target
        acc = {key: accuracy(prediction[cell_of == k], target[cell_of == k]) for k, key in enumerate(keys)}
        errors = {c: {s: 1 - acc[c, s] for s in self.severities} for c in self.corruptions}
        clean_error, clean_source = self._clean_error(trainer)
        derived = corruption_errors(errors, clean_error, self.alexnet_clean_error, fewer_images)
        per_corruption = {}
        for c in self.corruptions:
            mine = torch.isin(cell_of, torch.tensor([k for k, key in enumerate(keys) if key[0] == c]))
            per_corruption[c] = {
                "group": groups[c],
                "num_images": int(mine.sum()),
                "acc1": {str(s): acc[c, s] for s in self.severities},
                "error": {str(s): errors[c][s] for s in self.severities},
                "mean_acc1": sum(acc[c, s] for s in self.severities) / len(self.severities),
                "mean_error": sum(errors[c].values()) / len(self.severities),
                "ece": expected_calibration_error(confidence[mine], correct[mine]),
                "ce": derived["ce"][c],
                "relative_ce": derived["relative_ce"][c],
            }
        return {
            "corruptions": per_corruption,
            "severities": self.severities,
            "num_images": len(target),
            "mean_acc1": sum(acc.values()) / len(acc),  # over the evaluated corruption x severity cells
            "mean_error": 1 - sum(acc.values()) / len(acc),
            **{k: v for k, v in derived.items() if k not in ("ce", "relative_ce")},
            "clean_error": clean_error,
            "clean_error_source": clean_source,
            "alexnet": {
                "clean_error": self.alexnet_clean_error,
                "clean_error_source": ALEXNET_CLEAN_SOURCE
                if self.alexnet_clean_error == ALEXNET_CLEAN_ERROR
                else "init arg alexnet_clean_error",
                "errors": "data/imagenet_c_alexnet_err_per_severity.csv (standard 15), "
                "data/imagenet_c_alexnet_baselines.csv means (extra 4)",
            },
        }

    def _plot(self, section: dict[str, Any]):
        names = list(section["corruptions"])
        errors = [section["corruptions"][c]["mean_error"] for c in names]
        fig, ax = new_figure(figsize=(max(6, 0.5 * len(names)), 4))
        ax.bar(names, errors)
        ax.set_ylabel("top-1 error (mean over severities)")
        ax.set_ylim(0, 1)
        ax.set_title(f"ImageNet-C ({self.source}) error per corruption")
        ax.tick_params(axis="x", rotation=60)
        fig.tight_layout()
        return fig


def _known_size(dataset) -> int | None:
    """How many images an evaluation dataset holds, where it is known exactly (not for shard streams)."""
    return None if isinstance(dataset, IterableDataset) else len(dataset)


def flat_metrics(section: dict[str, Any]) -> dict[str, float]:
    """The scalars of the results section as ``imagenet_c/...`` logger keys (None values left out)."""
    metrics = {"imagenet_c/mean_acc1": section["mean_acc1"]}
    for key in ("mce", "relative_mce"):
        if section.get(key) is not None:
            metrics[f"imagenet_c/{key}"] = section[key]
        if (section.get(f"{key}_partial") or {}).get("value") is not None:
            metrics[f"imagenet_c/{key}_partial"] = section[f"{key}_partial"]["value"]
    for c, values in section["corruptions"].items():
        metrics[f"imagenet_c/{c}/acc1"] = values["mean_acc1"]
        for key in ("ce", "relative_ce", "ece"):
            if values[key] is not None:
                metrics[f"imagenet_c/{c}/{key}"] = values[key]
        for s, a in values["acc1"].items():
            metrics[f"imagenet_c/{c}/{s}/acc1"] = a
    return {k: float(v) for k, v in metrics.items()}
