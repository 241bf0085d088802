"""ImageNet-C (Hendrycks & Dietterich) as a Lightning callback:
``robust-lightning test --config configs/eval/imagenet_c.yaml --ckpt_path CKPT``.

Protocol (REFERENCE.md section 3; constants in data/, see data/PROVENANCE.md):

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
  evaluated; otherwise as ``mce_partial`` / ``relative_mce_partial`` with the corruptions and severities used.

Like DistributionShiftBenchmarks: the layout is checked in ``on_test_start`` (a wrong root fails before any
work), everything runs in ``on_test_end`` after the model's own test set, and under DDP the images are split
over the ranks and gathered exactly by ``benchmarks.predict_split``.
"""

import csv
from functools import cache
from pathlib import Path
from typing import Any

import torch
from lightning import Callback
from lightning.pytorch.loggers import WandbLogger
from PIL import Image

from robust_lightning.data.classes import class_map
from robust_lightning.errors import UserError
from robust_lightning.evaluation.benchmarks import (
    ECE_BINS,
    IMAGE_SUFFIXES,
    ExactSize,
    Split,
    accuracy,
    evaluation_resolution,
    expected_calibration_error,
    predict_split,
)
from robust_lightning.evaluation.results import update_results
from robust_lightning.paths import DATA_DIR

STANDARD = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
            "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
            "jpeg_compression")
EXTRA = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
ALL = STANDARD + EXTRA
GROUPS = ("noise", "blur", "weather", "digital", "extra")
SEVERITIES = (1, 2, 3, 4, 5)
RELEASED_SIZE = 224
# AlexNet's clean top-1 error: torchvision's pretrained AlexNet (acc@1 56.522%, the model the ImageNet-C paper
# evaluates; its Table 1 rounds the error to 43.5%). Not in data/: an init arg overrides it.
ALEXNET_CLEAN_ERROR = 0.43478
ALEXNET_CLEAN_SOURCE = "torchvision alexnet IMAGENET1K_V1 acc@1 56.522% (paper: 43.5% clean error)"

EXPECTED = (f"<root>/<corruption>/<severity 1..5>/<wnid>/*.JPEG (the released ImageNet-C layout), optionally "
            f"under group folders <root>/{{{','.join(GROUPS)}}}/<corruption>/<severity>/<wnid>/*.JPEG; "
            f"corruptions: {', '.join(ALL)}; wnids: the ImageNet-1k class folders (n01440764 ...)")


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
def corruption_errors(errors: dict[str, dict[int, float]], clean_error: float | None = None,
                      alexnet_clean_error: float = ALEXNET_CLEAN_ERROR) -> dict[str, Any]:
    """CE, relative CE, mCE and relative mCE from top-1 errors ``errors[corruption][severity]`` (fractions).

    Returns {"ce": {c: CE or None}, "relative_ce": {c: ... or None}} plus "mce" and "relative_mce" when every
    standard corruption has all 5 severities, else "mce_partial" / "relative_mce_partial" =
    {"value", "corruptions", "severities"} over the standard corruptions evaluated (None when there are none).
    Relative values need ``clean_error`` (else None)."""
    ce, relative = {}, {}
    for corruption, by_severity in errors.items():
        severities = sorted(by_severity)
        alexnet = _alexnet_sum(corruption, severities)
        ours = sum(by_severity.values())
        ce[corruption] = None if alexnet is None else ours / alexnet
        relative[corruption] = (None if alexnet is None or clean_error is None else
                                (ours - len(severities) * clean_error)
                                / (alexnet - len(severities) * alexnet_clean_error))
    standard = [c for c in STANDARD if c in errors]
    result: dict[str, Any] = {"ce": ce, "relative_ce": relative}
    complete = len(standard) == len(STANDARD) and all(sorted(errors[c]) == list(SEVERITIES) for c in standard)

    def mean(values: dict[str, float | None]) -> float | None:
        picked = [values[c] for c in standard]
        return None if not picked or None in picked else sum(picked) / len(picked)

    if complete:
        result.update(mce=mean(ce), relative_mce=mean(relative))
    else:  # a different key, so a partial number is never mistaken for the benchmark's mCE
        severities = sorted({s for c in standard for s in errors[c]})
        for key, values in (("mce_partial", ce), ("relative_mce_partial", relative)):
            result[key] = {"value": mean(values), "corruptions": standard, "severities": severities}
    return result


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
        raise UserError(f"ImageNet-C root {root}: corruptions found in more than one place {twice}; "
                        f"expected each once, {EXPECTED}")
    return {c: places[0] for c, places in found.items()}


def _subsample(samples: list[tuple[str, int]], limit_per_class: int | None,
               max_images: int | None) -> list[tuple[str, int]]:
    """Deterministic: the first ``limit_per_class`` files (sorted) of each class, then ``max_images`` evenly
    spaced over what is left. Every cell holds the same file names, so all cells keep the same images."""
    if limit_per_class is not None:
        kept, counts = [], {}
        for path, label in samples:
            counts[label] = counts.get(label, 0) + 1
            if counts[label] <= limit_per_class:
                kept.append((path, label))
        samples = kept
    if max_images is not None and len(samples) > max_images:
        samples = [samples[i * len(samples) // max_images] for i in range(max_images)]
    return samples


def imagenet_c_cells(root: str | Path, corruptions: list[str], severities: list[int],
                     limit_per_class: int | None = None, max_images: int | None = None,
                     ) -> tuple[dict[tuple[str, int], list[tuple[str, int]]], dict[str, str | None]]:
    """The images of every requested (corruption, severity) cell as (path, ImageNet label), and each
    corruption's group folder (None at the top level). Raises UserError on any layout problem."""
    found = find_corruptions(root)
    missing = [c for c in corruptions if c not in found]
    if missing:
        raise UserError(f"ImageNet-C root {root}: requested corruptions {missing} not found (found "
                        f"{sorted(found)}); expected {EXPECTED}")
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
            samples = [(str(p), label_of[w.name]) for w in wnids for p in sorted(w.iterdir())
                       if p.suffix.lower() in IMAGE_SUFFIXES]
            if not samples:
                raise UserError(f"{cell} holds no images; expected {EXPECTED}")
            cells[corruption, severity] = _subsample(samples, limit_per_class, max_images)
    return cells, {c: found[c][1] for c in corruptions}


def imagenet_val_test_set(datamodule) -> str | None:
    """A description of the datamodule's test set when it is ImageNet val (1000 ImageNet classes from a folder
    or shards, not a held-out train split), else None."""
    if (getattr(datamodule, "source", None) in ("folder", "shards") and getattr(datamodule, "class_map", None)
            == "imagenet" and not getattr(datamodule, "holdout", 0)):
        where = datamodule.root if datamodule.source == "folder" else datamodule.val_shards
        subset = [f"{k}={getattr(datamodule, k)}" for k in ("eval_subset", "eval_limit") if getattr(datamodule, k)]
        return f"ImageNet val ({where}{'; ' + ', '.join(subset) if subset else ''})"
    return None


# -------------------------------------------------------------------------------------------------- callback
class ImageNetC(Callback):
    """ImageNet-C top-1, error, CE / mCE, relative CE / mCE and ECE after ``test`` (see the module docstring).

    Args:
        root: the released ImageNet-C folder (flat or with group folders; see ``EXPECTED``).
        corruptions: "standard" (the 15 of mCE, default), "all" (the 15 + the 4 extra) or a list of names.
        severities: severities to evaluate (default 1..5). mCE proper needs the 15 standard at all 5.
        clean_error: the model's clean top-1 error for the relative CE. None: 1 - ``test/acc1`` of this run's
            own test loop when the datamodule's test set is ImageNet val (results.json says which was used);
            otherwise relative values are None.
        alexnet_clean_error: AlexNet's clean top-1 error (the relative CE's baseline).
        limit_per_class: evaluate only the first n images (sorted by file name) of each class in each cell.
        max_images: evaluate only n images per cell, evenly spaced over the (class-sorted) list: a quick,
            class-balanced look (e.g. 1000 = one image of each class). Both: subsampled results are
            labelled in results.json and are not comparable with published numbers.
        image_size: evaluation resolution (default: the model's ``image_size``, else the data's, else 224).
            Images are resized (bicubic, to image_size x image_size) only when it is not their size.
        batch_size: images per forward pass on each device.
        num_workers: decoding processes per device.
        plot: save a bar plot of the error per corruption (imagenet_c_errors.png beside results.json).
    """

    def __init__(
        self,
        root: str,
        corruptions: str | list[str] = "standard",
        severities: list[int] = list(SEVERITIES),
        clean_error: float | None = None,
        alexnet_clean_error: float = ALEXNET_CLEAN_ERROR,
        limit_per_class: int | None = None,
        max_images: int | None = None,
        image_size: int | None = None,
        batch_size: int = 64,
        num_workers: int = 4,
        plot: bool = True,
    ):
        if corruptions in ("standard", "all"):
            corruptions = list(STANDARD if corruptions == "standard" else ALL)
        elif isinstance(corruptions, str):
            corruptions = [corruptions]
        unknown = [c for c in corruptions if c not in ALL]
        if unknown or not corruptions:
            raise UserError(f"ImageNetC corruptions: unknown {unknown}; use 'standard', 'all' or names among "
                            f"{', '.join(ALL)}")
        bad = [s for s in severities if s not in SEVERITIES]
        if bad or not severities:
            raise UserError(f"ImageNetC severities must be among 1..5, got {list(severities)}")
        for name, value in (("limit_per_class", limit_per_class), ("max_images", max_images)):
            if value is not None and value < 1:
                raise UserError(f"ImageNetC {name} must be a positive number of images, got {value}")
        if clean_error is not None and not 0 <= clean_error <= 1:
            raise UserError(f"ImageNetC clean_error is a fraction in [0, 1], got {clean_error}")
        self.root = root
        self.corruptions = [c for c in ALL if c in corruptions]  # canonical order
        self.severities = sorted(set(severities))
        self.clean_error, self.alexnet_clean_error = clean_error, alexnet_clean_error
        self.limit_per_class, self.max_images = limit_per_class, max_images
        self.image_size, self.batch_size, self.num_workers, self.plot = image_size, batch_size, num_workers, plot

    def on_test_start(self, trainer, pl_module) -> None:
        """Check the whole layout before any work: a wrong root fails the run at once, not hours in."""
        self.cells, self.groups = imagenet_c_cells(self.root, self.corruptions, self.severities,
                                                   self.limit_per_class, self.max_images)
        self.resolution = evaluation_resolution(trainer, pl_module, self.image_size)

    def _clean_error(self, trainer) -> tuple[float | None, str]:
        if self.clean_error is not None:
            return self.clean_error, "init arg clean_error"
        test_set = imagenet_val_test_set(trainer.datamodule)
        acc1 = trainer.callback_metrics.get("test/acc1")
        if test_set and acc1 is not None:
            return 1 - float(acc1), f"1 - test/acc1 of this run's test loop on {test_set}"
        return None, "none: set clean_error, or test on ImageNet val in the same run"

    def on_test_end(self, trainer, pl_module) -> None:
        # one dataset over every cell: one loader, one gather; cell_of maps each image back to its cell
        keys = list(self.cells)
        samples = [s for key in keys for s in self.cells[key]]
        cell_of = torch.tensor([k for k, key in enumerate(keys) for _ in self.cells[key]])
        was_training = pl_module.training
        pl_module.eval()
        predictions = predict_split(trainer, pl_module, Split("imagenet_c", samples), ExactSize(self.resolution), None,
                                    batch_size=self.batch_size, num_workers=self.num_workers)
        cell_of = cell_of[predictions.index]  # unreadable images are skipped (and named in the results)
        target, prediction, confidence = predictions.target, predictions.prediction, predictions.confidence
        pl_module.train(was_training)
        run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective under DDP: every rank calls it
        if not trainer.is_global_zero:
            return
        section = self._section(trainer, keys, cell_of, target, prediction, confidence)
        section["corrupt_images"] = predictions.corrupt
        section["plot"] = self._plot(run_dir, section) if self.plot else "not requested"
        update_results(run_dir / "results.json", {"imagenet_c": section})
        metrics = flat_metrics(section)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            if isinstance(logger, WandbLogger) and self.plot:
                logger.log_image("imagenet_c/errors", [section["plot"]])
        mce = section.get("mce", (section.get("mce_partial") or {}).get("value"))
        print(f"imagenet_c: mean acc1 {section['mean_acc1']:.4f}, "
              f"{'mCE' if 'mce' in section else 'partial mCE'} {mce}", flush=True)

    def _section(self, trainer, keys, cell_of, target, prediction, confidence) -> dict[str, Any]:
        correct = prediction == target
        acc = {key: accuracy(prediction[cell_of == k], target[cell_of == k]) for k, key in enumerate(keys)}
        errors = {c: {s: 1 - acc[c, s] for s in self.severities} for c in self.corruptions}
        clean_error, clean_source = self._clean_error(trainer)
        derived = corruption_errors(errors, clean_error, self.alexnet_clean_error)
        per_corruption = {}
        for c in self.corruptions:
            mine = torch.isin(cell_of, torch.tensor([k for k, key in enumerate(keys) if key[0] == c]))
            per_corruption[c] = {
                "group": self.groups[c],
                "num_images": int(mine.sum()),
                "acc1": {str(s): acc[c, s] for s in self.severities},
                "error": {str(s): errors[c][s] for s in self.severities},
                "mean_acc1": sum(acc[c, s] for s in self.severities) / len(self.severities),
                "mean_error": sum(errors[c].values()) / len(self.severities),
                "ece": expected_calibration_error(confidence[mine], correct[mine]),
                "ce": derived["ce"][c],
                "relative_ce": derived["relative_ce"][c],
            }
        first = self.cells[keys[0]][0][0]
        with Image.open(first) as image:
            released = image.size
        r = self.resolution
        subsampled = self.limit_per_class is not None or self.max_images is not None
        return {
            "root": str(Path(self.root).resolve()),
            "layout": "group folders" if any(self.groups.values()) else "flat",
            "corruptions": per_corruption,
            "severities": self.severities,
            "num_images": len(target),
            "mean_acc1": sum(acc.values()) / len(acc),  # over the evaluated corruption x severity cells
            "mean_error": 1 - sum(acc.values()) / len(acc),
            **{k: v for k, v in derived.items() if k not in ("ce", "relative_ce")},
            "clean_error": clean_error,
            "clean_error_source": clean_source,
            "alexnet": {"clean_error": self.alexnet_clean_error,
                        "clean_error_source": ALEXNET_CLEAN_SOURCE if self.alexnet_clean_error == ALEXNET_CLEAN_ERROR
                        else "init arg alexnet_clean_error",
                        "errors": "data/imagenet_c_alexnet_err_per_severity.csv (standard 15), "
                                  "data/imagenet_c_alexnet_baselines.csv means (extra 4)"},
            "preprocessing": ("none (decoded as released)" if released == (r, r)
                              else f"resize {released[0]} x {released[1]} to {r} x {r} (bicubic)"),
            "conditions": {"image_size": r, "released_image_size": list(released), "ece_bins": ECE_BINS,
                           "subsampled": subsampled, "limit_per_class": self.limit_per_class,
                           "max_images": self.max_images, "checkpoint": trainer.ckpt_path},
        }

    @staticmethod
    def _plot(run_dir: Path, section: dict[str, Any]) -> str:
        import matplotlib  # noqa: PLC0415 (imported only when a plot is drawn: it is slow to import)

        matplotlib.use("Agg")  # no display on compute nodes
        import matplotlib.pyplot as plt  # noqa: PLC0415

        names = list(section["corruptions"])
        errors = [section["corruptions"][c]["mean_error"] for c in names]
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(names)), 4))
        ax.bar(names, errors)
        ax.set_ylabel("top-1 error (mean over severities)")
        ax.set_ylim(0, 1)
        ax.set_title("ImageNet-C error per corruption")
        ax.tick_params(axis="x", rotation=60)
        fig.tight_layout()
        path = run_dir / "imagenet_c_errors.png"
        run_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return str(path.resolve())


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
