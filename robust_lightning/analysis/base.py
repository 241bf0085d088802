"""What every analysis callback shares: its images, its model, and how it publishes a result.

An analysis runs in ``on_test_end`` of ``robust-lightning test`` (after the test loop, with gradients on),
on the first ``max_images`` evaluation images of the data module (the same subset and preprocessing as the
test), and publishes one section of results.json, one PNG beside it (logged to W&B when a WandbLogger is
present) and its scalars to the loggers. Analyses run in one process: they are cheap next to training, and
most of them (lesion, Hessian spectra, ...) are not sums over images that ranks could split.
"""

from pathlib import Path
from typing import Any, Iterator

import torch
from lightning import Callback
from lightning.pytorch.loggers import WandbLogger
from torch import nn

from robust_lightning.data.transforms import eval_transform
from robust_lightning.errors import UserError
from robust_lightning.evaluation.results import update_results


class Analysis(Callback):
    """Base class. Subclasses set ``name`` (the results.json section) and implement ``analyse``.

    Args:
        max_images: evaluation images the analysis uses (the first ones of the test set).
        batch_size: images per forward pass.
        weights: "raw" or "ema" (the EMA weights of a model trained with model.ema_decay).
        plot: draw ``<name>.png`` beside results.json.
    """

    name = "analysis"

    def __init__(self, max_images: int = 256, batch_size: int = 64, weights: str = "raw", plot: bool = True):
        if max_images < 1 or batch_size < 1:
            raise UserError(f"{type(self).__name__}: max_images and batch_size must be positive")
        if weights not in ("raw", "ema"):
            raise UserError(f"{type(self).__name__}.weights must be 'raw' or 'ema', got {weights!r}")
        self.max_images, self.batch_size, self.weights, self.plot = max_images, batch_size, weights, plot

    # ------------------------------------------------------------------------------------------ inputs
    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.world_size > 1:
            raise UserError(f"{type(self).__name__} runs in one process: set trainer.devices 1")
        self.check(trainer, pl_module)

    def check(self, trainer, pl_module) -> None:
        """Refuse (UserError) a model the analysis does not apply to, before the test loop spends any time."""

    def model(self, pl_module) -> nn.Module:
        """The classifier in eval mode: [0, 1] images in, logits out (its timm network is ``.net``)."""
        if self.weights == "ema":
            if getattr(pl_module, "ema", None) is None:
                raise UserError(f"{type(self).__name__}.weights 'ema' needs a model trained with model.ema_decay")
            return pl_module.ema.module.eval()
        return pl_module.model.eval()

    def batches(self, trainer, pl_module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images in [0, 1], labels) on the model's device: the first ``max_images`` evaluation images."""
        seen = 0
        data = trainer.datamodule
        loader = data.eval_dataloader_with(eval_transform(data.image_size, data.crop_pct), self.batch_size)
        for batch in loader:
            if seen >= self.max_images:
                return
            take = min(len(batch["label"]), self.max_images - seen)
            seen += take
            yield (batch["image"][:take].to(pl_module.device).float().div_(255),
                   batch["label"][:take].to(pl_module.device))

    def images(self, trainer, pl_module) -> tuple[torch.Tensor, torch.Tensor]:
        """All of them at once (for analyses that need the whole set, e.g. random masks shared by images)."""
        parts = list(self.batches(trainer, pl_module))
        if not parts:
            raise UserError(f"{type(self).__name__}: the test set has no images")
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @torch.no_grad()
    def accuracy(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Top-1 accuracy of ``model`` on ``images`` ([0, 1], on the model's device), ``batch_size`` at a time."""
        correct = 0
        for start in range(0, len(images), self.batch_size):
            logits = model(images[start:start + self.batch_size])
            correct += int((logits.argmax(-1) == labels[start:start + self.batch_size]).sum())
        return correct / max(len(images), 1)

    # ----------------------------------------------------------------------------------------- running
    def analyse(self, trainer, pl_module) -> tuple[dict[str, Any], dict[str, float], Any]:
        """Returns (results.json section, scalar metrics, matplotlib figure or None)."""
        raise NotImplementedError

    def on_test_end(self, trainer, pl_module) -> None:
        was_training = pl_module.training
        with torch.inference_mode(False), torch.enable_grad():
            section, metrics, figure = self.analyse(trainer, pl_module)
        pl_module.train(was_training)
        self.publish(trainer, section, metrics, figure)

    def publish(self, trainer, section: dict[str, Any], metrics: dict[str, float], figure) -> None:
        run_dir = Path(trainer.log_dir or trainer.default_root_dir)
        # "images": the analysis's own count when it gives one (e.g. a dataset of its own), else max_images
        section = {**section, "conditions": {"images": self.max_images, **section.get("conditions", {}),
                                             "weights": self.weights, "checkpoint": trainer.ckpt_path}}
        if figure is not None:
            import matplotlib.pyplot as plt  # noqa: PLC0415 (slow to import; only when plotting)

            path = run_dir / f"{self.name}.png"
            run_dir.mkdir(parents=True, exist_ok=True)
            if self.plot:
                figure.savefig(path, dpi=100, bbox_inches="tight")
                section["plot"] = str(path.resolve())
            plt.close(figure)
        update_results(run_dir / "results.json", {self.name: section})
        keyed = {f"{self.name}/{k}": float(v) for k, v in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(keyed, step=trainer.global_step)
            if isinstance(logger, WandbLogger) and "plot" in section:
                logger.log_image(f"{self.name}/plot", [section["plot"]])
        print(f"{self.name}: {', '.join(f'{k}={v:.4g}' for k, v in metrics.items()) or 'done'}; "
              f"results: {(run_dir / 'results.json').resolve()}", flush=True)


def new_figure(*args, **kwargs):
    """A matplotlib figure on the file-only backend (compute nodes have no display)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt.subplots(*args, **kwargs)
