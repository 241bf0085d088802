"""What every analysis callback shares: its images, its model, and how it publishes a result.

An analysis runs in ``on_test_end`` of ``robust-lightning test`` (after the test loop, with gradients on),
on the first ``max_images`` evaluation images of the data module (the same subset and preprocessing as the
test), and publishes one section of results.json, one PNG beside it (logged to W&B when a WandbLogger is
present) and its scalars to the loggers. Analyses run in one process: they are cheap next to training, and
most of them (lesion, Hessian spectra, ...) are not sums over images that ranks could split.
"""

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, Self, cast

import torch
from lightning import LightningModule, Trainer
from PIL import Image
from torch import nn
from torchvision.transforms import v2 as T

from robust_lightning.data.transforms import decode_rgb, eval_resize_size
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import Evaluation, check_weights, evaluating
from robust_lightning.evaluation.base import new_figure as _new_figure
from robust_lightning.evaluation.evaluated_module import EvaluatedModule
from robust_lightning.job_signals import agree_to_stop, stop_requested
from robust_lightning.models.classifier import RobustClassifier

if TYPE_CHECKING:
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure

Section = dict[str, Any]  # a results.json section, or a mapping in one: its values are JSON's
# what an analysis gives: (results.json section, scalar metrics, matplotlib figure or None)
AnalysisResult = tuple[Section, dict[str, float], "Figure | None"]


class AnalysedModule(EvaluatedModule, Protocol):
    """What an analysis asks of the module it analyses: what an evaluation may (``EvaluatedModule``), and the
    LightningModule's device and train/eval mode. ImageClassifier provides it."""

    training: bool

    @property
    def device(self) -> torch.device: ...

    def train(self, mode: bool = True) -> Self: ...


def analysed(pl_module: LightningModule) -> AnalysedModule:
    """The LightningModule a hook is given, as the module an analysis reads: Lightning types it as any
    LightningModule; the analyses run on ImageClassifier, which provides AnalysedModule (not checked here)."""
    return cast(AnalysedModule, pl_module)


def stop_point() -> None:
    """Raise :class:`~robust_lightning.job_signals.JobStopped` where a job's signal was noted (SIGTERM, SLURM's
    requeue signal). Analyses run in one process (``Analysis.setup`` refuses more), so a stop needs no agreement
    with other ranks and can come inside an analysis's own loops, not only between its batches of images: a long
    computation on a large model would otherwise outlast a scheduler's grace period. Nothing is published."""
    if stop_requested() and (stop := agree_to_stop("evaluation")) is not None:
        raise stop


def new_figure(*args: int, **kwargs: Any) -> tuple["Figure", Any]:
    """The analyses' figures, as evaluations make them: ``plt.subplots(...)`` on the file-only backend, the figure
    and its axes (one Axes, or an array of them)."""
    figure_and_axes: tuple[Figure, Any] = _new_figure(*args, **kwargs)
    return figure_and_axes


# How the papers name model families in their legends (Bhojanapalli et al.: "ViT", "ResNet"; Park & Kim: "ViT",
# "ResNet", "AlterNet"; Chen et al.: "RepLKNet", "ConvNeXt"), matched in this order against the architecture name.
FAMILY_NAMES = (
    ("replknet", "RepLKNet"),
    ("alternet", "AlterNet"),
    ("convnext", "ConvNeXt"),
    ("vit", "ViT"),
    ("deit", "ViT"),
    ("resnet", "ResNet"),
    ("bit", "ResNet"),
)


# (marker, colour) of a family in Park & Kim's plots (their notebooks); other families: "s", tab:green
FAMILY_STYLES: dict[str | None, tuple[str, str]] = {"ViT": ("o", "tab:red"), "ResNet": ("D", "tab:blue")}


def model_family(arch: str | None) -> str | None:
    """The family of an architecture as the papers name it (``FAMILY_NAMES``), None for one they do not name."""
    return next((name for key, name in FAMILY_NAMES if key in arch.lower()), None) if arch else None


def model_label(arch: str | None) -> str:
    """A model's legend entry in a figure laid out as the papers': its family as they name it, then the
    architecture, e.g. "ViT (test_vit)"; the architecture alone for a family the papers do not name."""
    if not arch:
        return "model"
    family = model_family(arch)
    return f"{family} ({arch})" if family else arch


def family_style(arch: str | None) -> tuple[str, str]:
    """(marker, colour) of the model's family in Park & Kim's plots."""
    return FAMILY_STYLES.get(model_family(arch), ("s", "tab:green"))


# PIL filters an analysis may resize its images with instead of the data module's bicubic (Analysis.interpolation):
# Chen et al.'s feature-variance and occlusion scripts resize with torchvision's default, bilinear
# (github.com/Lauch1ng/LKRobust, feature_map_variance/main.py and occlusion_invariance/evaluate.py: Resize(256)).
INTERPOLATIONS = {"bicubic": T.InterpolationMode.BICUBIC, "bilinear": T.InterpolationMode.BILINEAR}


def eval_preprocessing(image_size: int, crop_pct: float, resize: str, interpolation: str) -> T.Compose:
    """The data module's evaluation preprocessing (robust_lightning.data.transforms.eval_transform, same geometry:
    "shorter_side" resizes the shorter side to floor(r / crop_pct) and centre-crops r, "whole" resizes the whole
    image to r x r) with PIL's ``interpolation`` filter; uint8 tensors, as the data module's."""
    if interpolation not in INTERPOLATIONS:
        raise UserError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    mode = INTERPOLATIONS[interpolation]
    if resize == "whole":
        return T.Compose([decode_rgb, T.Resize((image_size, image_size), interpolation=mode), T.PILToTensor()])
    return T.Compose(
        [
            decode_rgb,
            T.Resize(eval_resize_size(image_size, crop_pct), interpolation=mode),
            T.CenterCrop(image_size),
            T.PILToTensor(),
        ]
    )


def describe_preprocessing(image_size: int, crop_pct: float, resize: str, interpolation: str) -> str:
    """What results.json says of ``eval_preprocessing`` with these arguments."""
    if resize == "whole":
        return f"resize {image_size}x{image_size} {interpolation} (whole image, aspect ratio ignored), no crop"
    return f"resize {eval_resize_size(image_size, crop_pct)} {interpolation}, center crop {image_size}"


def resize_difference(resize: str, interpolation: str) -> str | None:
    """How an analysis's resizing departs from its paper where the paper leaves it open, or None.

    eval_resize "whole" is Bhojanapalli et al.'s preprocessing (App. A, "Image Preprocessing"), the only protocol
    here that asks for it; they do not name the filter."""
    if resize != "whole":
        return None
    return (
        f"images resized whole with PIL's {interpolation} filter, a choice of this code: Bhojanapalli et al. "
        "(App. A) do not name the filter; the ViT code whose checkpoints they evaluate "
        "(github.com/google-research/vision_transformer, vit_jax/input_pipeline.py) resizes with "
        "tf.image.resize, bilinear without antialiasing"
    )


def pi_axis(axis: "Axis") -> None:
    """Tick labels in units of pi ("0.5π"), as Park & Kim's frequency axes."""
    from matplotlib.ticker import FormatStrFormatter  # noqa: PLC0415

    axis.set_major_formatter(FormatStrFormatter("%.1fπ"))


class Analysis(Evaluation):
    """Base class. Subclasses set ``name`` (the results.json section) and implement ``analyse``.

    Args:
        max_images: evaluation images the analysis uses (the first ones of the test set).
        batch_size: images per forward pass.
        weights: "raw" or "ema" (the EMA weights of a model trained with model.ema_decay).
        plot: draw ``<name>.png`` beside results.json.
        interpolation: for analyses that offer it, the PIL filter their images are resized with ("bicubic" or
            "bilinear", the same geometry as the data's evaluation preprocessing); None: the data module's own
            preprocessing (bicubic), the images of the test loop.
    """

    name = "analysis"

    def __init__(
        self,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
        interpolation: str | None = None,
    ):
        if max_images < 1 or batch_size < 1:
            raise UserError(f"{type(self).__name__}: max_images and batch_size must be positive")
        check_weights(type(self).__name__, weights)
        if interpolation is not None and interpolation not in INTERPOLATIONS:
            raise UserError(
                f"{type(self).__name__}.interpolation must be null or one of {', '.join(INTERPOLATIONS)}, "
                f"got {interpolation!r}"
            )
        self.max_images, self.batch_size, self.weights, self.plot = max_images, batch_size, weights, plot
        self.interpolation = interpolation
        self.images_used = 0  # evaluation images read by the last run: max_images, or fewer where the data ran out
        self.preprocessed: str | None = None  # how the last run's evaluation images were resized, if it read any
        self.resized: tuple[str, str] | None = None  # (eval_resize, filter) of those images

    # ------------------------------------------------------------------------------------------ inputs
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise UserError(f"{type(self).__name__} runs in one process: set trainer.devices 1")
        self.check(trainer, analysed(pl_module))

    def check(self, trainer: Trainer, pl_module: AnalysedModule) -> None:
        """Refuse (UserError) a model the analysis does not apply to, before the test loop spends any time."""

    def model(self, pl_module: AnalysedModule) -> RobustClassifier:
        """The classifier in eval mode: [0, 1] images in, logits out (its timm network is ``.net``)."""
        return self.network(pl_module).eval()

    def batches(self, trainer: Trainer, pl_module: AnalysedModule) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images in [0, 1], labels) on the model's device: the first ``max_images`` evaluation images (fewer
        where the data has fewer). ``images_used`` counts them (the most of any pass, for analyses that pass over
        the images several times)."""
        seen = 0
        transform = self.preprocessing(trainer)
        data = self.check_data(trainer)
        self.resized = (data.eval_resize, self.interpolation or "bicubic")
        self.preprocessed = describe_preprocessing(data.image_size, data.crop_pct, *self.resized)
        for batch in self.eval_batches(
            trainer, pl_module, transform, limit=self.max_images, batch_size=self.batch_size
        ):
            seen += len(batch["label"])
            self.images_used = max(self.images_used, seen)
            yield batch["image"], batch["label"]

    def preprocessing(self, trainer: Trainer) -> Callable[[Image.Image], torch.Tensor] | None:
        """The per-image transform of the analysis's images: None (the data module's own evaluation
        preprocessing) unless ``interpolation`` names a filter."""
        if self.interpolation is None:
            return None
        data = self.check_data(trainer)
        transform: Callable[[Image.Image], torch.Tensor] = eval_preprocessing(
            data.image_size, data.crop_pct, data.eval_resize, self.interpolation
        )
        return transform

    def images(self, trainer: Trainer, pl_module: AnalysedModule) -> tuple[torch.Tensor, torch.Tensor]:
        """All of them at once (for analyses that need the whole set, e.g. random masks shared by images)."""
        parts = list(self.batches(trainer, pl_module))
        if not parts:
            raise UserError(f"{type(self).__name__}: the test set has no images")
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @torch.no_grad()
    def accuracy(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Top-1 accuracy of ``model`` on ``images`` ([0, 1], on the model's device), ``batch_size`` at a time. A
        job's signal stops it first (:func:`stop_point`): analyses such as LesionStudy call it many times."""
        stop_point()
        correct = 0
        for start in range(0, len(images), self.batch_size):
            logits = model(images[start : start + self.batch_size])
            correct += int((logits.argmax(-1) == labels[start : start + self.batch_size]).sum())
        return correct / max(len(images), 1)

    # ----------------------------------------------------------------------------------------- running
    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        """Returns (results.json section, scalar metrics, matplotlib figure or None)."""
        raise NotImplementedError

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.images_used, self.preprocessed, self.resized = 0, None, None
        with evaluating(pl_module), torch.inference_mode(False), torch.enable_grad():
            section, metrics, figure = self.analyse(trainer, analysed(pl_module))
        self.publish(trainer, section, metrics, figure)

    def publish(
        self,
        trainer: Trainer,
        section: Section | None,
        metrics: dict[str, float] | None,
        figure: "Figure | None" = None,
        tables: dict[str, tuple[list[str], list[list[Any]]]] | None = None,
        message: str | list[str] | Callable[[Section], str | list[str]] | None = None,
    ) -> Section | None:
        """As ``Evaluation.publish``, with the analysis's conditions added and its metrics under ``<name>/``."""
        # "images": those the analysis read (its own count when it gives one, e.g. a dataset of its own);
        # "max_images": the budget it was given (analyses run in one process: no sum over ranks)
        assert section is not None and metrics is not None  # one process: it is rank zero
        section = {
            **section,
            "conditions": {
                "images": self.images_used,
                "max_images": self.max_images,
                **section.get("conditions", {}),
                "weights": self.weights,
                "checkpoint": trainer.ckpt_path,
            },
        }
        if self.preprocessed is not None:
            section["conditions"]["eval_preprocessing"] = self.preprocessed
            assert self.resized is not None  # set with preprocessed
            difference = resize_difference(*self.resized)
            if difference is not None:
                protocol = section.get("protocol", {})
                section["protocol"] = {**protocol, "differences": [*protocol.get("differences", []), difference]}
        if figure is not None and not self.plot:
            import matplotlib.pyplot as plt  # noqa: PLC0415 (slow to import; only when plotting)

            plt.close(figure)
            figure = None
        keyed = {f"{self.name}/{k}": float(v) for k, v in metrics.items()}
        return super().publish(trainer, section, keyed, figure, tables, message)
