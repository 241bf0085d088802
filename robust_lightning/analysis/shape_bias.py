"""Shape bias on Geirhos et al.'s cue-conflict images (ICLR 2019; the stimuli of texture-vs-shape and
model-vs-human), as reported by Bhojanapalli et al. for ViTs and ResNets.

Layout of the folder (model-vs-human's ``cue-conflict``): ``ROOT/<shape category>/<shape><n>-<texture><m>.png``,
16 category folders (airplane, bear, ..., truck), e.g. ``ROOT/cat/cat2-elephant1.png``: the shape of a cat with
the texture of an elephant.

Decision of an ImageNet model: softmax over the 1000 classes, then the mean probability over each category's
ImageNet classes (data/cue_conflict_16class_to_imagenet.json), then the argmax over the 16 categories (the mean,
not the sum: categories with many ImageNet classes, like dog, do not win by count). Over the images whose shape
and texture categories differ:

    shape bias = shape decisions / (shape decisions + texture decisions)

(decisions that are neither do not count; model-vs-human's ShapeBias analysis counts the same way). Per category
(of the shape, as Geirhos et al.'s per-category plot) the same ratio. Bhojanapalli et al. (Sec. 3.7, Fig. 6,
Table 3) report another count, the shape accuracy: the fraction of ALL stimuli (1280, the ones whose shape and
texture agree included) whose decision is their shape category; it is ``shape_accuracy``. Preprocessing: the whole
stimulus resized to the model's resolution (bicubic; crop_pct < 1 adds the project's centre crop). A model with another
label space than ImageNet's 1000 classes does not apply.
"""

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning import LightningModule, Trainer
from PIL import Image
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate
from torchvision.transforms import v2 as T

from robust_lightning.analysis.core import (
    AnalysedModule,
    Analysis,
    AnalysisResult,
    Section,
    analysed,
    model_label,
    new_figure,
)
from robust_lightning.data.loaders import data_loader
from robust_lightning.data.transforms import BICUBIC, decode_rgb, eval_resize_size
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import data_image_size, to_model_input, until_stopped
from robust_lightning.paths import DATA_DIR

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAPPING = DATA_DIR / "cue_conflict_16class_to_imagenet.json"
NAME = re.compile(r"^([a-z]+)\d+-([a-z]+)\d+\.(png|jpe?g)$", re.IGNORECASE)
LAYOUT = (
    "ROOT/<shape category>/<shape><n>-<texture><m>.png with the 16 category folders (airplane, bear, ..., "
    "truck), e.g. ROOT/cat/cat2-elephant1.png (model-vs-human's cue-conflict folder)"
)


def load_mapping(path: str | Path | None = None) -> dict[str, list[int]]:
    """Category -> ImageNet class indices, categories in sorted order."""
    mapping = json.loads(Path(path or MAPPING).read_text())
    return {k: [int(i) for i in mapping[k]] for k in sorted(mapping)}


def cue_conflict_images(root: str | Path, categories: list[str]) -> list[tuple[Path, str, str]]:
    """(file, shape category, texture category) of every stimulus, or a UserError naming the expected layout."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"ShapeBias: cue-conflict root {root} does not exist; expected {LAYOUT}")
    folders = sorted(d.name for d in root.iterdir() if d.is_dir())
    unknown = [f for f in folders if f not in categories]
    if not folders or unknown:
        found = f"unknown folders {unknown[:5]}" if unknown else "no category folders"
        raise UserError(f"ShapeBias: {root} has {found}; expected {LAYOUT}")
    images = []
    for shape in folders:
        for file in sorted((root / shape).iterdir()):
            if file.name.startswith("."):
                continue
            match = NAME.match(file.name)
            if not match or match.group(2).lower() not in categories:
                raise UserError(
                    f"ShapeBias: {file} is not named <shape><n>-<texture><m>.png with a texture among "
                    f"the 16 categories; expected {LAYOUT}"
                )
            images.append((file, shape, match.group(2).lower()))
    if not images:
        raise UserError(f"ShapeBias: no images under {root}; expected {LAYOUT}")
    return images


class _Stimuli(Dataset[Tensor]):
    def __init__(self, files: list[Path], transform: Callable[[Image.Image], Tensor]) -> None:
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Tensor:
        with Image.open(self.files[i]) as image:
            return self.transform(image)


def stimulus_transform(image_size: int, crop_pct: float = 1.0) -> T.Compose:
    """The whole (square) stimulus resized to image_size; crop_pct < 1 resizes larger and centre-crops."""
    return T.Compose(
        [
            decode_rgb,
            T.Resize(eval_resize_size(image_size, crop_pct), interpolation=BICUBIC),
            T.CenterCrop(image_size),
            T.PILToTensor(),
        ]
    )


def category_probabilities(logits: Tensor, mapping: dict[str, list[int]]) -> Tensor:
    """(B, 16): mean softmax probability over each category's ImageNet classes, categories in mapping order."""
    probs = logits.float().softmax(1)
    return torch.stack([probs[:, idx].mean(1) for idx in mapping.values()], 1)


@torch.no_grad()
def decisions(
    model: nn.Module,
    files: list[Path],
    mapping: dict[str, list[int]],
    image_size: int,
    batch_size: int = 64,
    crop_pct: float = 1.0,
    device: torch.device | str = "cpu",
    num_workers: int = 0,
) -> list[str]:
    """The 16-class decision of the model for each file."""
    names = list(mapping)
    # the data module's loaders: workers that leave the job's signals to this process, and restarted where one
    # never started
    loader = data_loader(
        _Stimuli(files, stimulus_transform(image_size, crop_pct)),
        batch_size,
        num_workers=num_workers,
        collate_fn=default_collate,
    )
    out = []
    for images in until_stopped(loader):  # SIGTERM or SLURM's requeue signal: stop at the next batch
        logits = model(to_model_input(images, device))
        if logits.shape[1] != 1000:
            raise UserError(f"ShapeBias needs a model with ImageNet's 1000 classes; this one has {logits.shape[1]}")
        out += [names[i] for i in category_probabilities(logits, mapping).argmax(1).tolist()]
    return out


def shape_bias_table(stimuli: list[tuple[Path, str, str]], decided: list[str], categories: list[str]) -> dict[str, Any]:
    """Counts and ratios over the cue-conflict images (shape != texture), overall and per shape category."""
    conflict = [(s, t, d) for (_, s, t), d in zip(stimuli, decided) if s != t]
    shape_correct = sum(d == s for (_, s, _), d in zip(stimuli, decided))  # every stimulus: Bhojanapalli et al.
    shape = sum(d == s for s, _, d in conflict)
    texture = sum(d == t for _, t, d in conflict)

    def ratio(a: int, b: int) -> float | None:
        return a / (a + b) if a + b else None

    per_category = {}
    for c in categories:
        rows = [(s, t, d) for s, t, d in conflict if s == c]
        cs, ct = sum(d == s for s, _, d in rows), sum(d == t for _, t, d in rows)
        per_category[c] = {"images": len(rows), "shape": cs, "texture": ct, "shape_bias": ratio(cs, ct)}
    return {
        "shape_bias": ratio(shape, texture),
        "shape_accuracy": shape_correct / len(stimuli) if stimuli else None,
        "shape_decisions": shape,
        "texture_decisions": texture,
        "other_decisions": len(conflict) - shape - texture,
        "fraction_shape": shape / len(conflict) if conflict else None,
        "fraction_texture": texture / len(conflict) if conflict else None,
        "num_images": len(stimuli),
        "num_conflict_images": len(conflict),
        "excluded_same_category": len(stimuli) - len(conflict),
        "per_category": per_category,
    }


class ShapeBias(Analysis):
    """Shape bias of a 1000-class ImageNet model on a cue-conflict folder.

    Args:
        root: the cue-conflict folder (ROOT/<shape category>/<shape><n>-<texture><m>.png).
        mapping: JSON file category -> ImageNet class indices (default: data/cue_conflict_16class_to_imagenet.json).
        image_size: model resolution (default: data.image_size).
        crop_pct: 1.0 = the whole stimulus resized to image_size (the stimuli are square and 224 px); e.g.
            0.875 applies the project's evaluation crop.
        num_workers: image decoding processes.
        max_images: at most this many stimuli (the first ones in folder order); default all.
        batch_size, weights, plot: see Analysis.
    """

    name = "shape_bias"

    def __init__(
        self,
        root: str,
        mapping: str | None = None,
        image_size: int | None = None,
        crop_pct: float = 1.0,
        num_workers: int = 0,
        max_images: int = 100_000,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if not 0 < crop_pct <= 1:
            raise UserError(f"ShapeBias.crop_pct must be in (0, 1], got {crop_pct}")
        self.root, self.image_size, self.crop_pct, self.num_workers = root, image_size, crop_pct, num_workers
        path = Path(mapping) if mapping else MAPPING
        if not path.is_file():
            raise UserError(f"ShapeBias.mapping {path} does not exist; expected a JSON category -> ImageNet indices")
        self.mapping_path, self.mapping = path, load_mapping(path)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_test_start(trainer, pl_module)
        # fail before the test loop: wrong label space or wrong folder
        classes = analysed(pl_module).hparams.get("num_classes")
        if classes is not None and classes != 1000:
            raise UserError(
                f"ShapeBias does not apply to this model: it has {classes} classes, and the cue-conflict "
                "decision maps ImageNet's 1000 classes to 16 categories; use an ImageNet-1k checkpoint"
            )
        cue_conflict_images(self.root, list(self.mapping))

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        categories = list(self.mapping)
        stimuli = cue_conflict_images(self.root, categories)[: self.max_images]
        size = self.image_size or data_image_size(trainer)
        if size is None:
            raise UserError("ShapeBias: the data module has no image_size to default to; set ShapeBias.image_size")
        decided = decisions(
            self.model(pl_module),
            [f for f, _, _ in stimuli],
            self.mapping,
            size,
            self.batch_size,
            self.crop_pct,
            pl_module.device,
            self.num_workers,
        )
        section = {
            **shape_bias_table(stimuli, decided, categories),
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "images": len(stimuli),
                "root": str(Path(self.root).resolve()),
                "mapping": str(self.mapping_path),
                "image_size": size,
                "crop_pct": self.crop_pct,
                "decision": "argmax of the mean softmax probability over each category's classes",
            },
        }
        metrics = {
            k: section[k]
            for k in ("shape_bias", "shape_accuracy", "fraction_shape", "fraction_texture")
            if section[k] is not None
        }
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> "Figure":
        """Left: Bhojanapalli et al.'s Fig. 6, the model's "Shape accuracy (%)" (stimuli decided by their shape, of
        all of them), the model on the x axis. Right: Geirhos et al.'s view, shape decisions / (shape + texture
        decisions) per shape category."""
        figure, (left, ax) = new_figure(1, 2, figsize=(10, 6), gridspec_kw={"width_ratios": [1, 2]})
        label = model_label(section["conditions"].get("arch"))
        if section["shape_accuracy"] is not None:
            left.bar([label], [100 * section["shape_accuracy"]], color="C0")
        left.set_ylabel("Shape accuracy (%)")
        left.set_title(f"Conflict stimuli ({section['num_images']} images)", fontsize=10)
        rows = [(c, r["shape_bias"]) for c, r in section["per_category"].items() if r["shape_bias"] is not None]
        ax.scatter([v for _, v in rows], range(len(rows)), s=60, color="C3", label="per category")
        if section["shape_bias"] is not None:
            ax.axvline(
                section["shape_bias"],
                color="C3",
                linestyle="--",
                label=f"overall shape bias {section['shape_bias']:.2f}",
            )
        ax.set_yticks(range(len(rows)), [c for c, _ in rows])
        ax.set_xlim(-0.02, 1.02)
        ax.set_xlabel("fraction of shape decisions (shape / (shape + texture))")
        ax.set_title(f"Shape bias ({section['num_conflict_images']} cue-conflict images)", fontsize=10)
        secondary = ax.secondary_xaxis("top", functions=(lambda v: 1 - v, lambda v: 1 - v))
        secondary.set_xlabel("fraction of texture decisions")
        ax.legend(fontsize=8, loc="lower right")
        figure.tight_layout()
        return figure
