"""The base of every evaluation callback (AutoAttack, benchmarks, ImageNet-C/-P, resolution sweep, card) and of
every analysis: which weights are evaluated, the evaluation images, gathering over ranks, and one way to publish.

An evaluation reads the data module only through its public interface,
``robust_lightning.data.contract.EvaluationData``: e.g. ``eval_dataloader_with(transform, batch_size,
num_workers)`` (the evaluation images of the last ``setup``, this rank's share, through another per-image
transform), ``image_size``, ``crop_pct``, ``evaluation_source()`` and ``conditions()``. A batch carries the keys
of ``robust_lightning.data.batch``.

Publishing (``Evaluation.publish``) is the same for all: the section ``name`` merged into results.json beside
the run's other sections, the scalars to every logger, the plot saved beside results.json (and, with a
WandbLogger, the plot and any tables to W&B), and one console line.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning import Callback
from lightning.pytorch.loggers import WandbLogger
from torch import nn
from torch.utils.data import DataLoader

from robust_lightning.atomic import atomic_write
from robust_lightning.console import tqdm
from robust_lightning.data.batch import IMAGE, KEY, LABEL
from robust_lightning.data.contract import EvaluationData, EvaluationSource, evaluation_data
from robust_lightning.data.samplers import rank_share
from robust_lightning.data.transforms import ImageTransform
from robust_lightning.errors import UserError
from robust_lightning.evaluation.evaluated_module import EvaluatedModule, model_setting
from robust_lightning.evaluation.results import ResultsFile
from robust_lightning.job_signals import agree_to_stop, stop_requested
from robust_lightning.models.classifier import RobustClassifier
from robust_lightning.paths import run_directory

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WEIGHTS = ("raw", "ema")
T = TypeVar("T")


class OnDevice(Protocol):
    """What the evaluation batches ask of a module: the device to put the images on (a LightningModule, or an
    analysis' view of one)."""

    @property
    def device(self) -> torch.device: ...


# ------------------------------------------------------------------------------------------------ pieces
def to_model_input(images: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """uint8 images (as the loaders emit them) -> float in [0, 1] on ``device``, the models' input; float images
    (given as tensors to ``robust_lightning.evaluate``) are already that."""
    images = images.to(device)
    return images.float() if images.is_floating_point() else images.float().div_(255)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather_objects(value: T) -> list[T]:
    """Every rank's ``value`` (picklable), in rank order, on every rank; ``[value]`` in one process.
    A collective under DDP: every rank calls it."""
    if not distributed():
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()  # each rank's value, once gathered
    dist.all_gather_object(everyone, value)
    return everyone


def sum_over_ranks(per_key: Mapping[str, float]) -> dict[str, float]:
    """Per-key totals summed over the ranks (e.g. device-seconds per attack). A collective under DDP."""
    total: dict[str, float] = {}
    for part in gather_objects(dict(per_key)):
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total


def outcomes_parent(trainer: pl.Trainer) -> Path:
    """Where an evaluation keeps its per-image outcomes unless told: ``trainer.default_root_dir``, or its ``runs/``
    where that is the working directory (Lightning's default when it is unset), so that outcomes never land in the
    root of the working directory (a repository checkout) unless asked."""
    root = Path(trainer.default_root_dir)
    return root / "runs" if root.resolve() == Path.cwd().resolve() else root


def barrier(trainer: pl.Trainer) -> None:
    """Wait for every rank (e.g. until all their outcomes are on disk); nothing in one process."""
    trainer.strategy.barrier()


@contextmanager
def evaluating(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in eval mode inside the block, back in the mode it had afterwards, whatever happens."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def until_stopped(batches: Iterable[T]) -> Iterator[T]:
    """``batches`` up to SIGTERM or SLURM's requeue signal, noted by this rank or another; then, or at their end,
    every rank agrees whether to stop (a small collective under DDP: every rank iterates to the end or to its stop,
    and no rank calls another collective before that) and raises :class:`JobStopped` if so, before anything of
    the evaluation is published. An evaluation that saves its outcomes per batch keeps those of every batch it
    finished."""
    for batch in batches:
        if stop_requested():
            break
        yield batch
    stop = agree_to_stop("evaluation")
    if stop is not None:
        raise stop


def check_weights(owner: str, weights: str) -> None:
    if weights not in WEIGHTS:
        raise UserError(f"{owner}.weights must be 'raw' or 'ema', got {weights!r}")


# ------------------------------------------------------------------------------------------------- base
class Evaluation(Callback):
    """Base class of the evaluation callbacks. Subclasses set ``name``: their results.json section, the prefix
    of their logger keys and W&B panels, and the default plot file ``<name>.png``.

    Attributes a subclass may set: ``weights`` ("raw" or "ema", for callbacks with that option),
    ``plot_file`` (the plot's file name beside results.json) and ``plot_key`` (its W&B key ``<name>/<plot_key>``).
    """

    name = "evaluation"
    weights = "raw"
    plot_file: str | None = None
    plot_key = "plot"

    # ---------------------------------------------------------------------------------------- the model
    def network(self, pl_module: EvaluatedModule) -> RobustClassifier:
        """The network evaluated: the raw weights, or the EMA copy (``weights: ema``) of a model trained with
        model.ema_decay. [0, 1] images in, logits out. Its mode is left as it is (see ``evaluating``)."""
        if self.weights == "ema":
            if pl_module.ema is None:
                raise UserError(f"{type(self).__name__}.weights 'ema' needs a model trained with model.ema_decay")
            averaged: RobustClassifier = pl_module.ema.module
            return averaged
        return pl_module.model

    # ----------------------------------------------------------------------------------------- the data
    def check_data(self, trainer: pl.Trainer) -> EvaluationData:
        """The data module, if it can give the evaluation images (else a UserError, before any work)."""
        data = evaluation_data(trainer)
        if data is None:
            raise UserError(
                f"{type(self).__name__} reads the evaluation images through the datamodule: run it "
                "with robust_lightning's ImageNetDataModule (the data: section of the config)"
            )
        return data

    def eval_loader(
        self,
        trainer: pl.Trainer,
        transform: ImageTransform | None = None,
        batch_size: int | None = None,
        num_workers: int | None = None,
    ) -> DataLoader[object]:
        """This rank's evaluation images through ``transform`` (default None: the data's own preprocessing)."""
        return self.check_data(trainer).eval_dataloader_with(transform, batch_size, num_workers)

    def eval_batches(
        self,
        trainer: pl.Trainer,
        pl_module: OnDevice,
        transform: ImageTransform | None = None,
        limit: int | None = None,
        batch_size: int | None = None,
        num_workers: int | None = None,
        progress: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Batches {image: [0, 1] float on the module's device, label: on the device, key: names} of this
        rank's evaluation images. ``limit``: the first ``limit`` images over all ranks (each rank takes its
        share). ``progress``: show a progress bar (rank zero) with this description.

        After SIGTERM or SLURM's requeue signal the batches stop at the next one (:func:`until_stopped`)."""
        share = None if limit is None else rank_share(limit, trainer.world_size, trainer.global_rank)
        batches = self._share_of_batches(trainer, pl_module, share, transform, batch_size, num_workers, progress)
        yield from until_stopped(batches if share != 0 else iter(()))

    def _share_of_batches(
        self,
        trainer: pl.Trainer,
        pl_module: OnDevice,
        share: int | None,
        transform: ImageTransform | None,
        batch_size: int | None,
        num_workers: int | None,
        progress: str | None,
    ) -> Iterator[dict[str, Any]]:
        """This rank's batches for :meth:`eval_batches`."""
        loader = self.eval_loader(trainer, transform, batch_size, num_workers)
        bar = tqdm(loader, desc=progress, disable=progress is None or not trainer.is_global_zero, leave=False)
        seen = 0
        try:
            for batch in bar:
                take = len(batch[KEY]) if share is None else min(len(batch[KEY]), share - seen)
                if take:
                    seen += take
                    yield {
                        IMAGE: to_model_input(batch[IMAGE][:take], pl_module.device),
                        LABEL: batch[LABEL][:take].to(pl_module.device),
                        KEY: list(batch[KEY][:take]),
                    }
                if share is not None and seen >= share:
                    return
        finally:
            bar.close()

    # ---------------------------------------------------------------------------------------- publishing
    @staticmethod
    def run_dir(trainer: pl.Trainer) -> Path:
        """Where results.json and the plots go. A collective under DDP (every rank calls it)."""
        return run_directory(trainer, every_rank=True)

    def publish(
        self,
        trainer: pl.Trainer,
        section: dict[str, Any] | None,
        metrics: dict[str, float] | None,
        figure: "Figure | None" = None,
        tables: dict[str, tuple[list[str], list[list[Any]]]] | None = None,
        message: str | list[str] | Callable[[dict[str, Any]], str | list[str]] | None = None,
    ) -> dict[str, Any] | None:
        """Publish one result. Every rank calls it; only global rank zero writes (elsewhere the arguments may
        be None). Returns the section as written (None off rank zero).

        - ``section`` goes into results.json under ``name`` (merged: other sections are kept);
        - ``figure`` (matplotlib) is saved as ``plot_file`` beside results.json, its path under "plot", and
          logged to W&B as ``<name>/<plot_key>``;
        - ``metrics`` (logger keys, ``<name>/...``) go to every logger;
        - ``tables`` {key: (columns, rows)} go to W&B as ``<name>/<key>`` (those with rows);
        - ``message``: the console line(s), or a function of the section as written; default the metrics.
        """
        run_dir = self.run_dir(trainer)
        if not trainer.is_global_zero:
            _close(figure)
            return None
        assert section is not None  # rank zero passes its section
        section = dict(section)
        if figure is not None:
            path = run_dir / (self.plot_file or f"{self.name}.png")
            run_dir.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, "wb") as f:  # a kill mid-save never leaves a half-written plot
                figure.savefig(f, format=path.suffix.removeprefix(".") or "png", dpi=100, bbox_inches="tight")
            _close(figure)
            section["plot"] = str(path.resolve())
        results = ResultsFile.of(run_dir)
        results.write({self.name: section})
        metrics = {key: float(value) for key, value in (metrics or {}).items()}
        for logger in trainer.loggers:
            if metrics:
                logger.log_metrics(metrics, step=trainer.global_step)
            if isinstance(logger, WandbLogger):
                for key, (columns, rows) in (tables or {}).items():
                    if rows:
                        logger.log_table(f"{self.name}/{key}", columns=columns, data=rows)
                if figure is not None:
                    logger.log_image(f"{self.name}/{self.plot_key}", [section["plot"]])
        if callable(message):
            message = message(section)
        if message is None:
            shown = ", ".join(f"{k.removeprefix(self.name + '/')}={v:.4g}" for k, v in metrics.items())
            message = f"{self.name}: {shown or 'done'}; results: {results.path.resolve()}"
        for line in [message] if isinstance(message, str) else message:
            print(line, flush=True)
        return section


def _close(figure: "Figure | None") -> None:
    if figure is not None:
        import matplotlib.pyplot as plt  # noqa: PLC0415 (slow to import; only when there is a figure)

        plt.close(figure)


def new_figure(*args: Any, **kwargs: Any) -> tuple["Figure", Any]:
    """A matplotlib figure on the file-only backend (compute nodes have no display): ``plt.subplots(...)``."""
    import matplotlib  # noqa: PLC0415 (slow to import; only when plotting)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt.subplots(*args, **kwargs)


def data_image_size(trainer: pl.Trainer) -> int | None:
    """The data module's evaluation crop (``EvaluationData.image_size``), None for a data module without one."""
    data = evaluation_data(trainer)
    return data.image_size if data is not None else None


def evaluation_source(trainer: pl.Trainer) -> EvaluationSource | None:
    """Where the data module's evaluation images come from (``EvaluationData.evaluation_source``), None for a
    data module that does not say."""
    data = evaluation_data(trainer)
    return data.evaluation_source() if data is not None else None


def evaluation_resolution(trainer: pl.Trainer, pl_module: object, override: int | None) -> int:
    """The resolution an evaluation runs at: the override, else the model's, else the data's, else 224."""
    model_size = model_setting(pl_module, "image_size")
    return int(override or model_size or data_image_size(trainer) or 224)
