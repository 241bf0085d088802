"""Kernel attention distance of depthwise large kernels (Chen et al., "Revealing the Dark Secrets of Extremely
Large Kernel ConvNets on Robustness", ICML 2024; repo Lauch1ng/LKRobust, kernel_attention_pattern/).

For each channel of a depthwise k x k kernel W, with R = (k - 1) / 2 and d(i, j) the distance of tap (i, j) to
the kernel centre:

    distance = sum_ij |W_ij| * d(i, j) / (R * sqrt(2))

as the code that drew Fig. 9 computes it (kernel_attention_pattern/kernel_atten_dis.py: ``result =
np.multiply(distances, np.abs(a))``, ``mean_result = np.sum(result, axis=(1, 2))``, distances over
``max_dis = R * np.sqrt(2)``), then sorted over the channels. This raw sum grows with the scale of the weights.
``normalize: true`` divides it by sum_ij |W_ij| per channel: the |W|-weighted mean distance of the taps, a
fraction of the corner distance (0 when all weight sits on the centre tap, 1 on the corners), comparable across
layers and models. Large values mean the kernel "attends" far from the centre, as attention in a ViT does.

Layers are found by shape, not by name, so every model family works: any ``nn.Conv2d`` with
``groups == in_channels`` (depthwise) and a kernel side of at least ``min_kernel_size`` (timm ConvNeXt's
``conv_dw``, RepLKNet's large kernels, merged or not). RepLKNet's parallel small kernels (``small_conv`` of
``ReparamLargeKernelConv``) are left out unless ``small_kernels: true``: the reference reads
``large_kernel.lkb_origin.conv.weight`` only. Non-square kernels use the corner distance sqrt(Rh^2 + Rw^2).
A model without such layers (ResNet, ViT) gets a clear "does not apply" error before the test runs.
No images are needed: the analysis reads the weights only.
"""

import math
import re
from typing import TYPE_CHECKING

import torch
from lightning import LightningModule, Trainer
from torch import Tensor, nn

from robust_lightning.analysis.core import (
    AnalysedModule,
    Analysis,
    AnalysisResult,
    Section,
    analysed,
    model_label,
    new_figure,
)
from robust_lightning.errors import UserError
from robust_lightning.evaluation.evaluated_module import model_setting
from robust_lightning.models.replknet import ReparamLargeKernelConv

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def kernel_distance(weight: Tensor, normalize: bool = False) -> Tensor:
    """Per output channel of a depthwise kernel (C, 1, kh, kw) (or (C, kh, kw)): the |W|-weighted distance of
    its taps from the centre in units of the corner distance. Channels whose weights are all zero give NaN
    when normalised."""
    w = weight.detach().float().abs()
    if w.dim() == 4:
        w = w.reshape(w.shape[0], -1, *w.shape[-2:]).sum(1)  # one input channel per group in a depthwise conv
    if w.dim() != 3:
        raise ValueError(f"expected a depthwise kernel (C, 1, kh, kw), got shape {tuple(weight.shape)}")
    kh, kw = w.shape[-2:]
    rh, rw = (kh - 1) / 2, (kw - 1) / 2
    corner = math.hypot(rh, rw)
    if corner == 0:
        return torch.zeros(w.shape[0])  # a 1 x 1 kernel is all centre
    rows = torch.arange(kh, dtype=torch.float32) - rh
    cols = torch.arange(kw, dtype=torch.float32) - rw
    distance = torch.sqrt(rows[:, None] ** 2 + cols[None, :] ** 2) / corner
    total = (w * distance).sum((1, 2))
    if not normalize:
        return total
    mass = w.sum((1, 2))
    return torch.where(mass > 0, total / mass.clamp_min(1e-30), torch.full_like(total, math.nan))


def is_depthwise(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Conv2d)
        and module.groups > 1
        and module.groups == module.in_channels
        and module.out_channels % module.in_channels == 0
    )


def depthwise_convs(
    net: nn.Module, min_kernel_size: int = 7, small_kernels: bool = True
) -> list[tuple[str, nn.Conv2d]]:
    """(name, conv) of every depthwise conv whose larger kernel side is at least ``min_kernel_size``;
    ``small_kernels`` False leaves out the parallel small kernels of RepLKNet's ``ReparamLargeKernelConv``."""
    small = (
        set()
        if small_kernels
        else {
            id(conv)
            for m in net.modules()
            if isinstance(m, ReparamLargeKernelConv) and m.small_conv is not None
            for conv in m.small_conv.modules()
        }
    )
    return [
        (name, m)
        for name, m in net.named_modules()
        if is_depthwise(m) and max(m.kernel_size) >= min_kernel_size and id(m) not in small
    ]


def stage_of(name: str) -> str:
    """The stage a layer belongs to, from its name: everything up to the first numeric component
    (``stages.2.blocks.5.conv_dw`` -> ``stages.2``, ``layers.1.0.conv`` -> ``layers.1``); "all" if none."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if re.fullmatch(r"\d+", part):
            return ".".join(parts[: i + 1])
    return "all"


class KernelAttentionDistance(Analysis):
    """Kernel attention distance per depthwise large-kernel layer and stage (Chen et al.).

    Args:
        min_kernel_size: smallest kernel side that counts as large (7 includes ConvNeXt's 7 x 7; Chen et al.
            study RepLKNet's 31/29/27/13 and ConvNeXt with 3-51).
        normalize: false (default): the raw sum of the reference code; true: divided by sum |W| per channel
            (the weighted mean distance, in [0, 1]).
        small_kernels: also measure RepLKNet's parallel small kernels (the reference does not).
        weights, plot: see Analysis (max_images and batch_size are unused: only weights are read).
    """

    name = "kernel_distance"

    def __init__(
        self,
        min_kernel_size: int = 7,
        normalize: bool = False,
        small_kernels: bool = False,
        weights: str = "raw",
        plot: bool = True,
        max_images: int = 1,
        batch_size: int = 1,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if min_kernel_size < 2:
            raise UserError(f"KernelAttentionDistance.min_kernel_size must be >= 2, got {min_kernel_size}")
        self.min_kernel_size, self.normalize, self.small_kernels = min_kernel_size, normalize, small_kernels

    def layers(self, pl_module: AnalysedModule) -> list[tuple[str, nn.Conv2d]]:
        """The measured layers, or a UserError saying why the analysis does not apply to this model."""
        net = getattr(self.model(pl_module), "net", self.model(pl_module))
        found = depthwise_convs(net, self.min_kernel_size, self.small_kernels)
        if not found:
            sizes = sorted({max(m.kernel_size) for _, m in depthwise_convs(net, 1)})
            arch = model_setting(pl_module, "arch") or type(net).__name__
            seen = f"its depthwise kernels are {sizes} px" if sizes else "it has no depthwise convolutions"
            raise UserError(
                f"KernelAttentionDistance does not apply to {arch}: it measures depthwise large kernels (kernel "
                f">= min_kernel_size {self.min_kernel_size}) and {seen}. Use a large-kernel ConvNet checkpoint "
                "(RepLKNet, ConvNeXt with 7x7 or larger kernels), or lower min_kernel_size."
            )
        return found

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_test_start(trainer, pl_module)
        self.layers(analysed(pl_module))  # fail before the test loop, not after it

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        per_layer: list[Section] = []
        channels: dict[str, torch.Tensor] = {}
        for name, conv in self.layers(pl_module):
            d = kernel_distance(conv.weight, self.normalize)
            valid = d[~d.isnan()]
            channels[name] = valid
            per_layer.append(
                {
                    "layer": name,
                    "stage": stage_of(name),
                    "kernel_size": list(conv.kernel_size),
                    "channels": int(d.numel()),
                    "zero_channels": int(d.isnan().sum()),
                    "mean": float(valid.mean()) if valid.numel() else math.nan,
                    "std": float(valid.std()) if valid.numel() > 1 else 0.0,
                    "median": float(valid.median()) if valid.numel() else math.nan,
                    "min": float(valid.min()) if valid.numel() else math.nan,
                    "max": float(valid.max()) if valid.numel() else math.nan,
                    "sorted": valid.sort().values.tolist(),  # the per-channel curve Chen et al. plot (Fig. 9)
                }
            )
        stages: dict[str, Section] = {}
        for stage in dict.fromkeys(row["stage"] for row in per_layer):
            values = torch.cat([channels[row["layer"]] for row in per_layer if row["stage"] == stage])
            stages[stage] = {
                "layers": sum(row["stage"] == stage for row in per_layer),
                "mean": float(values.mean()) if values.numel() else math.nan,
            }
        everything = torch.cat(list(channels.values()))
        mean = float(everything.mean()) if everything.numel() else math.nan
        section = {
            "mean": mean,
            "stages": stages,
            "layers": per_layer,
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "images": 0,
                "min_kernel_size": self.min_kernel_size,
                "normalize": self.normalize,
                "small_kernels": self.small_kernels,
                "definition": "sum |W| d / (R sqrt 2)"
                + (
                    " / sum |W| per channel (normalised, not the reference's)"
                    if self.normalize
                    else " per channel, as the reference code (kernel_atten_dis.py)"
                ),
            },
        }
        figure = self.figure(section) if self.plot else None
        metrics = {"mean": mean, **{f"{stage}/mean": s["mean"] for stage, s in stages.items()}}
        return section, metrics, figure

    @staticmethod
    def figure(section: Section) -> "Figure":
        """Chen et al.'s Fig. 9 (left): the sorted per-channel "Kernel attention distance" against the "Normalized
        channel index" of the first two layers of stage 1 and the last two of stage 3 (of the last stage for a
        model with fewer), one line per layer ("Stage 1, layer 1", ...). Right: the mean (+/- std) over channels of
        every measured layer in depth order, coloured by stage."""
        layers = section["layers"]
        stages = list(dict.fromkeys(row["stage"] for row in layers))
        by_stage = {s: [row for row in layers if row["stage"] == s] for s in stages}
        shown = [(0, i) for i in range(min(2, len(by_stage[stages[0]])))]
        late = 2 if len(stages) > 2 else len(stages) - 1
        if late:
            count = len(by_stage[stages[late]])
            shown += [(late, i) for i in range(max(count - 2, 0), count)]
        figure, (left, right) = new_figure(1, 2, figsize=(12, 4.5))
        for s, i in shown:
            values = by_stage[stages[s]][i]["sorted"]
            if values:
                left.plot(torch.linspace(0, 1, len(values)).tolist(), values, label=f"Stage {s + 1}, layer {i + 1}")
        left.set_xlabel("Normalized channel index")
        left.set_ylabel("Kernel attention distance")
        left.set_title(model_label(section["conditions"].get("arch")))
        left.legend(fontsize=8)
        colours = {s: f"C{i % 10}" for i, s in enumerate(stages)}
        for i, row in enumerate(layers):
            right.errorbar(i, row["mean"], yerr=row["std"], color=colours[row["stage"]], marker="o", alpha=0.7)
        for i, s in enumerate(stages):
            right.scatter([], [], color=colours[s], label=f"Stage {i + 1}")
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

        right.xaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_xlabel("Layer (depth order)")
        right.set_ylabel("Kernel attention distance")
        right.set_title("Mean over channels (± std) per layer")
        right.legend(fontsize=8)
        figure.tight_layout()
        return figure
