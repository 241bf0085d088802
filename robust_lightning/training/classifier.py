"""Clean training and evaluation of an image classifier; the adversarial recipe builds on this module."""

from functools import partial

import torch
import torch.nn.functional as F
from lightning import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from timm.optim import create_optimizer_v2
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric, MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from robust_lightning.errors import UserError
from robust_lightning.models.classifier import build_classifier
from robust_lightning.models.weights import load_pretrained
from robust_lightning.training.schedule import warmup_cosine


def accuracy_metrics(num_classes: int) -> MetricCollection:
    # micro averaging = plain top-k accuracy over images (torchmetrics defaults to macro)
    return MetricCollection(
        {
            "acc1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
            "acc5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
        }
    )


class ImageClassifier(LightningModule):
    """A timm model on [0, 1] images, trained with the optimiser and schedule of Singh et al.

    Args:
        arch: timm model name (any timm model or tag, or a registered ConvStem variant).
        num_classes: size of the label space (linked from the data module by the CLI).
        image_size: input resolution, passed to architectures that need it (ViTs); linked from the data.
        mean: per-channel mean of the model's normaliser; None = the model takes [0, 1] input as is.
        std: per-channel std of the normaliser (set with mean).
        arch_kwargs: extra keyword arguments for timm.create_model (e.g. drop_path_rate).
        init_from: warm start from a local checkpoint (.ckpt, .pt/.pth state dict or .safetensors); a
            ConvStem model takes all non-stem weights from its PatchStem counterpart. Ignored when the
            trainer resumes from a checkpoint.
        lr: peak learning rate.
        min_lr: final learning rate of the cosine decay.
        warmup_epochs: linear warm-up length in epochs (may be fractional).
        weight_decay: AdamW weight decay; biases, norm weights and embeddings are not decayed (timm rule).
        betas: AdamW betas.
        label_smoothing: label smoothing of the cross-entropy.
        channels_last: run the model in channels_last memory format (faster convolutions on GPU).
    """

    def __init__(
        self,
        arch: str = "convnext_tiny_convstem",
        num_classes: int = 1000,
        image_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        arch_kwargs: dict | None = None,
        init_from: str | None = None,
        lr: float = 1e-3,
        min_lr: float = 5e-6,
        warmup_epochs: float = 10.0,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.95),
        label_smoothing: float = 0.1,
        channels_last: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = build_classifier(arch, num_classes, image_size, mean, std, arch_kwargs or {})
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.warm_start_report = None
        self.train_metrics = accuracy_metrics(num_classes).clone(prefix="train/")
        self.val_metrics = accuracy_metrics(num_classes).clone(prefix="val/")
        self.test_metrics = accuracy_metrics(num_classes).clone(prefix="test/")
        self.eval_loss = MeanMetric()
        self.eval_images = SumMetric()

    def setup(self, stage: str) -> None:
        # Warm start here rather than in __init__: a resumed run (ckpt_path) and load_from_checkpoint() must
        # not need the original init_from file.
        if self.hparams.init_from and self.trainer.ckpt_path is None and self.warm_start_report is None:
            self.warm_start_report = load_pretrained(self.model, self.hparams.init_from)
            rank_zero_info(str(self.warm_start_report))

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint of another architecture with one clear message instead of a state_dict traceback."""
        ours = self.state_dict()
        theirs = checkpoint.get("state_dict", {})
        mismatched = sorted(
            [f"{k} (missing in checkpoint)" for k in ours.keys() - theirs.keys()]
            + [f"{k} (not in this model)" for k in theirs.keys() - ours.keys()]
            + [f"{k} (checkpoint {tuple(theirs[k].shape)} vs model {tuple(v.shape)})"
               for k, v in ours.items() if k in theirs and theirs[k].shape != v.shape]
        )
        if mismatched:
            arch = checkpoint.get("hyper_parameters", {}).get("arch", "unknown")
            listed = "\n  ".join(mismatched[:20]) + (f"\n  ... {len(mismatched) - 20} more" if len(mismatched) > 20 else "")
            raise UserError(
                f"the checkpoint holds a {arch!r} model (num_classes "
                f"{checkpoint.get('hyper_parameters', {}).get('num_classes')}), incompatible with the configured "
                f"{self.hparams.arch!r} (num_classes {self.hparams.num_classes}); mismatched keys:\n  {listed}"
            )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.model(images)

    # ------------------------------------------------------------------------------------------- training
    def training_step(self, batch: dict, batch_idx: int):
        images, labels = batch["image"], batch["label"]
        if labels.numel() == 0:  # every image of this batch was corrupt (reported by CorruptImageReport)
            return None
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_metrics.update(logits.detach(), labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=labels.numel())
        return loss

    def on_train_epoch_end(self) -> None:
        self.log_dict(self.train_metrics.compute(), sync_dist=True)
        self.train_metrics.reset()

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = create_optimizer_v2(self.model.net, "adamw", lr=hp.lr, weight_decay=hp.weight_decay, betas=hp.betas)
        total = self.trainer.estimated_stepping_batches
        epochs = max(1, self.trainer.max_epochs or 1)
        warmup = round(total * hp.warmup_epochs / epochs)
        # LambdaLR scales each group's lr by a factor, so the schedule is divided by the peak
        schedule = partial(warmup_cosine, total_steps=total, warmup_steps=warmup, peak_lr=1.0, min_lr=hp.min_lr / hp.lr)
        scheduler = LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------------- evaluation
    def _eval_step(self, batch: dict, metrics: MetricCollection) -> None:
        images, labels = batch["image"], batch["label"]
        if labels.numel() == 0:
            return
        logits = self(images)
        loss = F.cross_entropy(logits, labels, reduction="sum")
        self.eval_loss.update(loss / labels.numel(), weight=labels.numel())
        self.eval_images.update(labels.numel())
        metrics.update(logits, labels)

    def _eval_epoch_end(self, metrics: MetricCollection, stage: str) -> None:
        # compute() sums the counts of all ranks before dividing: exact, unlike averaging per-rank means. The
        # results are then equal on every rank, so sync_dist (a mean of equal values) changes nothing.
        self.log_dict(metrics.compute(), sync_dist=True)
        self.log(f"{stage}/loss", self.eval_loss.compute(), sync_dist=True)
        self.log(f"{stage}/num_images", self.eval_images.compute(), sync_dist=True)
        for metric in (metrics, self.eval_loss, self.eval_images):
            metric.reset()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end(self.val_metrics, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end(self.test_metrics, "test")

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        probs = self(batch["image"]).float().softmax(-1)
        top = probs.topk(min(5, probs.shape[-1]), dim=-1)
        return {"key": batch["key"], "label": batch["label"], "top5": top.indices, "top5_prob": top.values}

    # ------------------------------------------------------------------------------------------ reporting
    def conditions(self) -> dict:
        """What results.json records about the model."""
        hp = self.hparams
        return {
            "arch": hp.arch,
            "num_classes": hp.num_classes,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            "input": "[0,1] RGB" + (f", normalised inside the model with mean {hp.mean} std {hp.std}" if hp.mean else ""),
            "init_from": hp.init_from,
            "warm_start": None if self.warm_start_report is None else str(self.warm_start_report),
        }
