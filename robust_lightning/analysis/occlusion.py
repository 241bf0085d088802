"""Occlusion (Chen et al. 2024, Fig. 4, after Naseer et al. 2021): accuracy when image patches are zeroed.

The image is cut into a ``grid`` x ``grid`` grid of patches (14 x 14 patches of 16 px at 224 px) and patches
are set to 0 in [0, 1] pixel space (before the model's normaliser):

- random drop: a fraction 0-90% of the patches, drawn per image, ``samples`` draws (mean, s.e., min, max);
- salient drop: the patches holding the top lambda of a saliency map's mass (sorted by saliency);
- non-salient drop: the patches holding the bottom lambda of the mass. (Chen et al.'s code keeps the top
  lambda' and drops the rest, which is this at lambda = 1 - lambda'.)

Saliency maps, all offline: ``attention`` - the model's own CLS attention to the patches in its last block
(ViTs); ``gradient`` - |d logit / d x| of the predicted class, max over colour channels (any model);
``checkpoint`` - the CLS attention of a DINO-style ViT loaded from a local file (Chen et al.: DINO ViT-S/16,
head 1), e.g. ``dino_deitsmall16_pretrain.pth``. Maps are pooled onto the occlusion grid (mass per patch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import timm
import torch
import torch.nn.functional as F
from lightning import Trainer
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn

from robust_lightning.analysis.blocks import as_map, attention_probabilities, find_blocks
from robust_lightning.analysis.core import AnalysedModule, Analysis, AnalysisResult, Section, model_label, new_figure
from robust_lightning.analysis.lesion import summary
from robust_lightning.console import tqdm
from robust_lightning.errors import UserError
from robust_lightning.models.checkpoints import read_state_dict
from robust_lightning.models.classifier import RobustClassifier

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Occlusion", "cls_attention", "drop_patches", "mass_mask", "random_patch_mask"]

SALIENCY_SOURCES = ("none", "attention", "gradient", "checkpoint")


# --------------------------------------------------------------------------------------------- masks
def drop_patches(images: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """``images`` (B, C, H, W) with the grid cells where ``dropped`` (B, g, g) is True set to 0."""
    keep = (~dropped).float()[:, None]
    return images * F.interpolate(keep, size=images.shape[-2:], mode="nearest")


def random_patch_mask(batch: int, grid: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """(B, g, g) masks with floor(fraction * g^2) cells chosen uniformly at random per image."""
    count = int(fraction * grid * grid + 1e-9)
    ranks = torch.rand(batch, grid * grid, generator=generator).argsort(dim=1).argsort(dim=1)
    return (ranks < count).reshape(batch, grid, grid)


def mass_mask(saliency: torch.Tensor, lam: float, salient: bool) -> torch.Tensor:
    """(B, g, g) masks of the cells holding the top (``salient``) or bottom lambda of each map's mass.

    Cells are sorted by saliency, c_k the cumulative mass up to and including cell k. Top lambda: c_k > 1 -
    lambda, the fewest cells that hold at least lambda of the mass (as Chen et al. threshold DINO attention);
    lambda = 1 takes every cell. Bottom lambda: c_k <= lambda, exactly the cells the top 1 - lambda leaves."""
    flat = saliency.flatten(1).double().clamp_min(0)
    flat = flat / flat.sum(dim=1, keepdim=True).clamp_min(1e-30)
    values, order = flat.sort(dim=1)
    cumulative = values.cumsum(dim=1)
    tol = 1e-6  # saliency is float32: mass shares equal to lambda must not fall out by rounding
    if salient:
        chosen_sorted = cumulative > 1 - lam + tol if lam < 1 else torch.ones_like(cumulative, dtype=torch.bool)
    else:
        chosen_sorted = cumulative <= lam + tol
    chosen = torch.zeros_like(chosen_sorted)
    chosen.scatter_(1, order, chosen_sorted)
    return chosen.reshape(saliency.shape)


def to_grid(saliency: torch.Tensor, image_hw: tuple[int, int], grid: int) -> torch.Tensor:
    """A (B, h, w) saliency map as mass per occlusion cell (B, grid, grid)."""
    pixels = F.interpolate(saliency[:, None].float(), size=image_hw, mode="nearest")
    return F.adaptive_avg_pool2d(pixels, grid)[:, 0]


# ------------------------------------------------------------------------------------------ saliency
def cls_attention(vit: nn.Module, tokens_in: torch.Tensor, block: int = -1, head: int | None = None) -> torch.Tensor:
    """(B, h, w) attention of the CLS query to the patches in ``vit.blocks[block]`` (one head, or the mean)."""
    bmap = find_blocks(vit)
    bmap.require_cls("attention saliency")
    timm_vit: Any = vit  # a timm ViT: blocks (their attn), forward_features
    target = timm_vit.blocks[block]
    seen: dict[str, torch.Tensor] = {}
    hook = target.attn.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))  # returns None
    try:
        timm_vit.forward_features(tokens_in)
    finally:
        hook.remove()
    probs = attention_probabilities(target.attn, seen["x"])  # (B, heads, N, N)
    if head is not None and not 0 <= head < probs.shape[1]:
        raise UserError(f"saliency_head {head}: the attention has {probs.shape[1]} heads")
    probs = probs[:, head] if head is not None else probs.mean(dim=1)  # (B, N, N)
    cls_row = probs[:, 0, :, None]  # (B, N, 1): the CLS query's weights as a one-channel token feature
    return as_map(cls_row, bmap, (tokens_in.shape[-2], tokens_in.shape[-1]))[:, 0]


def gradient_saliency(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, H, W) |d logit_pred / d x|, max over channels (Simonyan et al.)."""
    x = images.detach().clone().requires_grad_(True)
    logits = model(x)
    score = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
    (grad,) = torch.autograd.grad(score, x)
    return grad.abs().amax(dim=1)


def load_saliency_vit(path: str, arch: str) -> nn.Module:
    """A DINO-style ViT from a local state dict (no head needed); no download ever."""
    try:
        vit = timm.create_model(arch, pretrained=False, num_classes=0, dynamic_img_size=True)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"Occlusion.saliency_arch {arch!r}: cannot build it as a timm ViT ({e})") from e
    if find_blocks(vit).family != "vit":
        raise UserError(f"Occlusion.saliency_arch {arch!r} is not a Vision Transformer")
    state = {k.removeprefix("backbone."): v for k, v in read_state_dict(path).items()}  # DINO teacher/student keys
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    fit = f"Occlusion.saliency_checkpoint {path} does not fit {arch}"
    try:
        missing, unexpected = vit.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes differ
        raise UserError(
            f"{fit} ({str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else e}); "
            "set saliency_arch to the checkpoint's ViT"
        ) from e
    missing = [k for k in missing if not k.startswith("head.")]
    if missing or unexpected:
        raise UserError(
            f"{fit}: missing {missing[:5]}, unexpected {unexpected[:5]}; set saliency_arch to the checkpoint's ViT"
        )
    return vit.eval().requires_grad_(False)


class Occlusion(Analysis):
    """Accuracy under patch drop (random, salient, non-salient).

    Args:
        grid: patches per side (14: 16-px patches at 224 px; sizes that do not divide evenly get uneven patches).
        drop_fractions: fractions of patches dropped at random.
        samples: random draws per fraction.
        saliency: "gradient", "attention" (own CLS attention: ViTs), "checkpoint" (a DINO-style ViT at
            ``saliency_checkpoint``) or "none" (random drop only).
        lambdas: shares of saliency mass dropped (salient) or kept out (non-salient).
        saliency_checkpoint: local file (.pth state dict or .safetensors) of the saliency ViT.
        saliency_arch: timm name of that ViT (DINO ViT-S/16: vit_small_patch16_224).
        saliency_head: attention head of the CLS map (Chen et al.: 1); null: mean over heads.
        saliency_normalize: normalise the saliency ViT's input with ImageNet mean/std (DINO was trained so).
        seed: seed of the random drops.
        interpolation: the resize filter (see Analysis): Chen et al.'s occlusion script resizes bilinearly
            (github.com/Lauch1ng/LKRobust, occlusion_invariance/evaluate.py: Resize(256), CenterCrop(224)).
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "occlusion"

    def __init__(
        self,
        grid: int = 14,
        drop_fractions: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
        samples: int = 1,
        saliency: str = "gradient",
        lambdas: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
        saliency_checkpoint: str | None = None,
        saliency_arch: str = "vit_small_patch16_224",
        saliency_head: int | None = 1,
        saliency_normalize: bool = True,
        seed: int = 0,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
        interpolation: str | None = None,
    ):
        super().__init__(
            max_images=max_images, batch_size=batch_size, weights=weights, plot=plot, interpolation=interpolation
        )
        if grid < 1 or samples < 1:
            raise UserError("Occlusion: grid and samples must be positive")
        if not all(0 <= f <= 1 for f in [*drop_fractions, *lambdas]):
            raise UserError("Occlusion: drop_fractions and lambdas must lie in [0, 1]")
        if saliency not in SALIENCY_SOURCES:
            raise UserError(f"Occlusion.saliency must be one of {', '.join(SALIENCY_SOURCES)}, got {saliency!r}")
        if saliency == "checkpoint":
            if not saliency_checkpoint:
                raise UserError(
                    "Occlusion.saliency 'checkpoint' needs saliency_checkpoint: the path of a DINO-style "
                    "ViT state dict (e.g. dino_deitsmall16_pretrain.pth)"
                )
            if not Path(saliency_checkpoint).is_file():
                raise UserError(f"Occlusion.saliency_checkpoint not found: {saliency_checkpoint}")
        self.grid, self.drop_fractions, self.samples = grid, list(drop_fractions), samples
        self.saliency, self.lambdas = saliency, list(lambdas)
        self.saliency_checkpoint, self.saliency_arch = saliency_checkpoint, saliency_arch
        self.saliency_head, self.saliency_normalize, self.seed = saliency_head, saliency_normalize, seed
        self._saliency_vit: nn.Module | None = None

    def check(self, trainer: Trainer, pl_module: AnalysedModule) -> None:
        if self.saliency == "attention":
            find_blocks(pl_module.model.net).require_cls(
                "Occlusion.saliency 'attention' (the model's own CLS attention)"
            )
            vit: Any = pl_module.model.net  # a timm ViT (it has a CLS token): blocks, their attn
            if self.saliency_head is not None and self.saliency_head >= vit.blocks[-1].attn.num_heads:
                raise UserError(
                    f"Occlusion.saliency_head {self.saliency_head}: the model's attention has "
                    f"{vit.blocks[-1].attn.num_heads} heads"
                )
        if self.saliency == "checkpoint" and self._saliency_vit is None:
            assert self.saliency_checkpoint is not None  # saliency "checkpoint" needs one (__init__)
            self._saliency_vit = load_saliency_vit(self.saliency_checkpoint, self.saliency_arch)

    def saliency_maps(self, model: RobustClassifier, images: torch.Tensor) -> torch.Tensor:
        """(B, grid, grid) saliency mass per cell, ``batch_size`` images at a time."""
        parts = []
        for start in range(0, len(images), self.batch_size):
            x = images[start : start + self.batch_size]
            if self.saliency == "gradient":
                s = gradient_saliency(model, x)
            elif self.saliency == "attention":
                with torch.no_grad():
                    s = cls_attention(model.net, model.normalize(x), head=self.saliency_head)
            else:
                assert self._saliency_vit is not None  # loaded at setup
                vit = self._saliency_vit.to(x.device)
                if self.saliency_normalize:
                    mean = torch.tensor(IMAGENET_DEFAULT_MEAN, device=x.device).view(1, -1, 1, 1)
                    std = torch.tensor(IMAGENET_DEFAULT_STD, device=x.device).view(1, -1, 1, 1)
                    x_in = (x - mean) / std
                else:
                    x_in = x
                with torch.no_grad():
                    s = cls_attention(vit, x_in, head=self.saliency_head)
            parts.append(to_grid(s.detach(), (images.shape[-2], images.shape[-1]), self.grid))
        return torch.cat(parts)

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        images, labels = self.images(trainer, pl_module)
        model = self.model(pl_module)
        generator = torch.Generator().manual_seed(self.seed)
        with_saliency = self.saliency != "none"
        total = len(self.drop_fractions) * self.samples + (2 * len(self.lambdas) + 1 if with_saliency else 0)
        with tqdm(total=total, desc="occlusion", disable=not trainer.is_global_zero, leave=False) as bar:

            def measure(dropped: torch.Tensor) -> float:
                acc = self.accuracy(model, drop_patches(images, dropped.to(images.device)), labels)
                bar.update()
                return acc

            clean = self.accuracy(model, images, labels)
            random = {}
            for fraction in self.drop_fractions:
                accs = [
                    measure(random_patch_mask(len(images), self.grid, fraction, generator)) for _ in range(self.samples)
                ]
                random[f"{fraction:g}"] = summary(accs)
            section: Section = {"grid": self.grid, "clean_accuracy": clean, "random": random}
            metrics = {"clean_accuracy": clean, **{f"random_{k}": v["mean"] for k, v in random.items()}}
            if with_saliency:
                saliency = self.saliency_maps(model, images)
                bar.update()
                salient = {f"{lam:g}": measure(mass_mask(saliency, lam, salient=True)) for lam in self.lambdas}
                non_salient = {f"{lam:g}": measure(mass_mask(saliency, lam, salient=False)) for lam in self.lambdas}
                section |= {"salient": salient, "non_salient": non_salient}
                metrics |= {f"salient_{k}": v for k, v in salient.items()} | {
                    f"non_salient_{k}": v for k, v in non_salient.items()
                }
        section["conditions"] = {
            "arch": pl_module.hparams.get("arch"),
            "samples": self.samples,
            "seed": self.seed,
            "image_size": list(images.shape[-2:]),
            "fill": "0 in [0, 1] pixel space",
            "saliency": {
                "source": self.saliency,
                "checkpoint": self.saliency_checkpoint,
                "arch": self.saliency_arch if self.saliency == "checkpoint" else None,
                "head": self.saliency_head if self.saliency in ("attention", "checkpoint") else None,
            },
        }
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> Figure:
        """Chen et al.'s Fig. 4: (a) random, (b) salient and (c) non-salient drop, "Top-1 accuracy drop (%)" (occluded
        minus clean accuracy: negative, as their Table 5 reports it) against the "Information loss ratio (%)": the
        share of patches dropped at random, or of the saliency mass in the dropped patches. The model is the
        legend entry; random drop has standard-error bars over its draws."""
        label = model_label(section["conditions"].get("arch"))
        clean = section["clean_accuracy"]
        panels = [("random", "Random drop")]
        if "salient" in section:
            panels += [("salient", "Salient drop"), ("non_salient", "Non-salient drop")]
        fig, axes = new_figure(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (kind, title) in zip(axes[0], panels):
            keys = list(section[kind])
            xs = [100 * float(k) for k in keys]
            if kind == "random":
                ax.errorbar(
                    xs,
                    [100 * (section[kind][k]["mean"] - clean) for k in keys],
                    yerr=[100 * section[kind][k]["stderr"] for k in keys],
                    marker="o",
                    capsize=3,
                    label=label,
                )
            else:
                ax.plot(xs, [100 * (section[kind][k] - clean) for k in keys], marker="o", label=label)
            ax.set_xlabel("Information loss ratio (%)")
            ax.set_ylabel("Top-1 accuracy drop (%)")
            source = "" if kind == "random" else f", saliency: {section['conditions']['saliency']['source']}"
            ax.set_title(f"{title} ({section['grid']}x{section['grid']} patches{source})", fontsize=10)
            ax.legend(fontsize=8)
        fig.tight_layout()
        return fig
