"""What the hidden states of a model look like, block by block.

- ``LayerCorrelation`` (Bhojanapalli et al. 2021, Figs. 7, 31-33): the absolute value of the Pearson correlation
  between the outputs of every pair of units, over all images, tokens (or positions) and channels ("all"), or
  over the CLS token only ("cls": ViTs). For a model whose units differ in shape (ConvNet stages) every cell is
  linear CKA instead, as the paper's App. F does for ResNets (Fig. 33: "Linear Centered Kernel Analysis. This
  allows for the comparison of representations across stages which are of different shape").
- ``FeatureVariance`` (Park & Kim 2022, Fig. 9): spatial variance of each feature map, averaged over channels
  and images. MSAs lower it (they aggregate), convolutions and MLPs raise it. Chen et al. 2024 (Fig. 10) take
  the variance of each batch's mean map, at the points and on the batches of their script (protocol and points
  "chen", sweeps 10).
- ``FourierFeatures`` (Park & Kim 2022, Figs. 2a and 8): log amplitude of the 2-D Fourier transform of each
  feature map, averaged over channels and images, along the diagonal from frequency 0 towards the corner,
  relative to frequency 0; the value at the last point ("1.0 pi") per block. MSAs act as low-pass filters (it
  drops), convolutions as high-pass filters (it rises). The grid is that of Park & Kim's code
  (github.com/xxxnell/how-do-vits-work, fourier_analysis.ipynb): see ``relative_log_amplitude``.

Token features (ViTs) drop their CLS / register tokens and go onto the patch grid for the last two; with
``sublayers`` a transformer block gives two points (after its attention and after its MLP branch), as in the
paper's plots, and the stem (patch embedding) output is the first point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning import Trainer
from torch import nn

from robust_lightning.analysis.blocks import BlockMap, FeatureTap, as_map, find_blocks
from robust_lightning.analysis.core import (
    AnalysedModule,
    Analysis,
    AnalysisResult,
    Section,
    family_style,
    model_label,
    new_figure,
    pi_axis,
)
from robust_lightning.console import tqdm
from robust_lightning.errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "CorrelationAccumulator",
    "FeatureVariance",
    "FourierFeatures",
    "LayerCorrelation",
    "LinearCKAAccumulator",
    "feature_variance",
    "fourier_grid",
    "relative_log_amplitude",
    "unbiased_hsic",
]

# what _FeatureAnalysis.run hands each batch's features to: (blocks, features in tap order, image (H, W))
Consumer = Callable[[BlockMap, list[torch.Tensor], tuple[int, int]], None]

LOG_EPS = 1e-6  # added to Fourier amplitudes before the log (as Park & Kim do): dead channels give log(eps) flat


# --------------------------------------------------------------------------------------------- measures
def feature_variance(maps: torch.Tensor) -> torch.Tensor:
    """(B,) spatial variance of (B, C, H, W) maps (unbiased, over H x W), averaged over channels; NaN for 1x1 maps."""
    flat = maps.float().flatten(2)
    if flat.shape[-1] < 2:
        return flat.new_full(flat.shape[:1], float("nan"))
    return flat.var(dim=-1).mean(dim=1)


def fourier_grid(size: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Park & Kim's frequency grid for an n x n map: (DFT bins k, plotted frequencies, true frequencies), in pi.

    Their code rolls the 2-D FFT by n // 2 (DC to the centre) and keeps ``diag()[n // 2:]``: the diagonal bins
    (k, k), k = 0 .. n - n // 2 - 1, plotted at ``np.linspace(0, 1, len)`` (0 to "1.0 pi"). The last point is bin
    ceil(n / 2) - 1, whose true frequency 2k / n is pi (1 - 2 / n) for even n (14x14: 6/7 pi), not the Nyquist
    bin n / 2, which the roll puts at index 0, outside the half-diagonal."""
    bins = list(range(size - size // 2))
    plotted = (
        torch.linspace(0, 1, len(bins), dtype=torch.float64) if len(bins) > 1 else torch.zeros(1, dtype=torch.float64)
    )
    return bins, plotted, 2 * torch.tensor(bins, dtype=torch.float64) / size


def relative_log_amplitude(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(plotted frequencies in units of pi, (B, K) log amplitude relative to frequency 0) on Park & Kim's grid.

    For (B, C, H, W) maps: log(|FFT2| + eps) per channel, averaged over channels, read at the diagonal bins
    (k, k) of ``fourier_grid(min(H, W))`` (their code reads square maps; a non-square map uses the bins of its
    shorter side), minus the value at frequency 0."""
    bins, plotted, _ = fourier_grid(min(maps.shape[-2:]))
    log_amp = torch.log(torch.fft.fft2(maps.float()).abs() + LOG_EPS).mean(dim=1)  # (B, H, W)
    index = torch.tensor(bins, device=maps.device)
    diagonal = log_amp[:, index, index]
    return plotted, diagonal - diagonal[:, :1]


class CorrelationAccumulator:
    """Pearson correlations between L features, accumulated over batches (sums in float64).

    ``add`` takes one batch as a list of L tensors; features of the same shape (beyond the batch dimension) are
    correlated, others get NaN."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, ...], dict[str, Any]] = {}

    def add(self, features: list[torch.Tensor]) -> None:
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, f in enumerate(features):
            by_shape.setdefault(tuple(f.shape[1:]), []).append(i)
        for shape, index in by_shape.items():
            stacked = torch.stack([features[i].detach().reshape(-1) for i in index]).double()  # (Lg, M)
            group = self.groups.setdefault(shape, {"index": index, "n": 0, "sum": 0.0, "gram": 0.0})
            if group["index"] != index:
                raise UserError("the layers' feature shapes changed between batches")
            group["n"] += stacked.shape[1]
            group["sum"] = group["sum"] + stacked.sum(dim=1)
            group["gram"] = group["gram"] + stacked @ stacked.T

    def matrix(self, num_layers: int) -> torch.Tensor:
        corr = torch.full((num_layers, num_layers), float("nan"), dtype=torch.float64)
        for group in self.groups.values():
            mean = group["sum"] / group["n"]
            cov = group["gram"] / group["n"] - torch.outer(mean, mean)
            std = cov.diagonal().clamp_min(0).sqrt()
            block = cov / torch.outer(std, std)  # NaN for a constant feature
            index = torch.tensor(group["index"])
            corr[index[:, None], index[None, :]] = block.cpu()
        return corr


def unbiased_hsic(grams: torch.Tensor) -> torch.Tensor:
    """(L, L) unbiased HSIC (Song et al. 2012) between L (n, n) Gram matrices of the same n >= 4 examples."""
    n = grams.shape[-1]
    k = grams * (1 - torch.eye(n, dtype=grams.dtype, device=grams.device))  # zero diagonal
    rows = k.sum(dim=-1)  # (L, n): K 1
    totals = rows.sum(dim=-1)  # (L,): 1' K 1
    trace = torch.einsum("iab,jab->ij", k, k)  # tr(K_i K_j), Gram matrices being symmetric
    return (trace + torch.outer(totals, totals) / ((n - 1) * (n - 2)) - 2 / (n - 2) * rows @ rows.T) / (n * (n - 3))


class LinearCKAAccumulator:
    """Linear CKA between L features of any shapes, estimated over batches as Nguyen et al. (2021) do for
    large networks: CKA_ij = mean HSIC_1(K_i, K_j) / sqrt(mean HSIC_1(K_i, K_i) mean HSIC_1(K_j, K_j)), with
    K = X X^T the linear Gram matrix of a batch (each example's features flattened) and HSIC_1 the unbiased
    estimator, so no batch needs every image's features. Batches of fewer than 4 examples cannot be used."""

    MIN_BATCH = 4

    def __init__(self) -> None:
        self.hsic: torch.Tensor | float = 0.0
        self.batches = 0

    def add(self, features: list[torch.Tensor]) -> None:
        if len(features[0]) < self.MIN_BATCH:
            return
        flat = [f.detach().reshape(len(f), -1).double() for f in features]
        grams = torch.stack([x @ x.T for x in flat])  # (L, n, n)
        self.hsic = self.hsic + unbiased_hsic(grams).cpu()
        self.batches += 1

    def matrix(self, num_layers: int) -> torch.Tensor:
        if not self.batches:
            raise UserError(f"linear CKA needs batches of at least {self.MIN_BATCH} images: raise batch_size")
        assert isinstance(self.hsic, torch.Tensor)  # a batch was added
        scale = self.hsic.diagonal().sqrt()
        return self.hsic / torch.outer(scale, scale)


def _nullable(matrix: torch.Tensor) -> list[list[float | None]]:
    return [[None if math.isnan(v) else v for v in row] for row in matrix.tolist()]


def _subsampling(sizes: list[tuple[int, ...]]) -> list[bool]:
    """Which points follow a subsampling layer: their feature map is smaller than the point's before."""
    return [i > 0 and math.prod(size) < math.prod(sizes[i - 1]) for i, size in enumerate(sizes)]


def depth_axis(ax: Axes, points: list[Section], key: str, arch: str | None, colour_by_depth: bool = False) -> None:
    """``point[key]`` against normalised depth as Park & Kim's Figs. 8 and 9: x "Normalized depth" from 0 to 1,
    y "Δ Log amplitude" / "Feature map variance", gray spans ending at each MSA (attention) point and blue
    spans at each subsampling point (their notebooks' ``axvspan(x - 1 / depth, x)``); Fig. 8 colours the curve
    by depth (plasma)."""
    depth = max(len(points) - 1, 1)
    xs = [i / depth for i in range(len(points))]
    for x, p in zip(xs, points):
        if p.get("subsampling"):
            ax.axvspan(x - 1 / depth, x, color="tab:blue", alpha=0.15, lw=0)
        if p["kind"] == "attention":
            ax.axvspan(x - 1 / depth, x, color="tab:gray", alpha=0.15, lw=0)
    kept = [(x, p[key]) for x, p in zip(xs, points) if p[key] is not None]
    marker, colour = family_style(arch)
    if colour_by_depth and kept:
        import matplotlib  # noqa: PLC0415

        cmap = matplotlib.colormaps["plasma"]
        ax.plot([x for x, _ in kept], [v for _, v in kept], color="lightgray", zorder=1)
        ax.scatter([x for x, _ in kept], [v for _, v in kept], c=[cmap(x) for x, _ in kept], marker=marker, zorder=2)
    else:
        ax.plot([x for x, _ in kept], [v for _, v in kept], marker=marker, color=colour)
    ax.set_xlim(0.0, 1.0)
    ax.set_xlabel("Normalized depth")
    ax.set_title(model_label(arch))


class _FeatureAnalysis(Analysis):
    """Runs the model over the images with a FeatureTap and hands each batch's features to ``consume``."""

    def __init__(
        self,
        sublayers: bool = True,
        stem: bool = True,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
        interpolation: str | None = None,
    ):
        super().__init__(
            max_images=max_images, batch_size=batch_size, weights=weights, plot=plot, interpolation=interpolation
        )
        self.sublayers, self.stem = sublayers, stem

    def check(self, trainer: Trainer, pl_module: AnalysedModule) -> None:
        find_blocks(pl_module.model.net)

    def tap(self, net: nn.Module, bmap: BlockMap) -> FeatureTap:
        return FeatureTap(net, bmap, sublayers=self.sublayers, stem=self.stem)

    def run(
        self,
        trainer: Trainer,
        pl_module: AnalysedModule,
        consume: Consumer,
        batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[BlockMap, FeatureTap]:
        """Hands ``consume`` the tap's features of each batch: ``batches`` (images, labels) when given, else the
        analysis's images batch by batch."""
        model = self.model(pl_module)
        bmap = find_blocks(model.net)
        tap = self.tap(model.net, bmap)
        with tap, torch.no_grad():
            for images, _ in tqdm(
                self.batches(trainer, pl_module) if batches is None else batches,
                desc=self.name,
                leave=False,
                disable=not trainer.is_global_zero,
                total=math.ceil(self.max_images / self.batch_size) if batches is None else len(batches),
            ):
                model(images)
                consume(bmap, tap.ordered(), (images.shape[-2], images.shape[-1]))
        return bmap, tap


MEASURES = ("auto", "abs_pearson", "linear_cka")


class LayerCorrelation(_FeatureAnalysis):
    """Similarity of unit outputs across depth (Bhojanapalli et al., Figs. 7 and 31-33).

    Args:
        tokens: "all" (all tokens / positions and channels) and/or "cls" (the CLS token only; ViTs).
        stem: also the stem output (the patch embeddings) as layer 0.
        measure: "abs_pearson" (|Pearson correlation|, the paper's ViT plots), "linear_cka" (the paper's ResNet
            plot, defined between outputs of different shapes) or "auto": abs_pearson when every output has the
            same shape, else linear_cka for every cell. The CLS token is always compared with abs_pearson.
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "layer_correlation"

    def __init__(
        self,
        tokens: Sequence[str] = ("all", "cls"),
        stem: bool = False,
        measure: str = "auto",
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(False, stem, max_images, batch_size, weights, plot)
        self.tokens = list(tokens)
        if not self.tokens or not set(self.tokens) <= {"all", "cls"}:
            raise UserError(f"LayerCorrelation.tokens must be a non-empty list of 'all' and 'cls', got {tokens!r}")
        if measure not in MEASURES:
            raise UserError(f"LayerCorrelation.measure must be one of {', '.join(MEASURES)}, got {measure!r}")
        if measure == "linear_cka" and batch_size < LinearCKAAccumulator.MIN_BATCH:
            raise UserError(f"LayerCorrelation: linear CKA needs batch_size >= {LinearCKAAccumulator.MIN_BATCH}")
        self.measure = measure

    def check(self, trainer: Trainer, pl_module: AnalysedModule) -> None:
        bmap = find_blocks(pl_module.model.net)
        if "cls" in self.tokens:
            try:
                bmap.require_cls("LayerCorrelation with tokens 'cls'")
            except UserError as e:
                raise UserError(f"{e}; set tokens: [all] for the correlation over all positions") from None

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        accumulators: dict[str, CorrelationAccumulator | LinearCKAAccumulator] = (
            {"cls": CorrelationAccumulator()} if "cls" in self.tokens else {}
        )
        measures = {"cls": "abs_pearson"}

        def consume(bmap: BlockMap, features: list[torch.Tensor], image_hw: tuple[int, int]) -> None:
            if "all" in self.tokens:
                if "all" not in accumulators:  # the measure follows from the shapes of the first batch
                    same_shape = len({tuple(f.shape[1:]) for f in features}) == 1
                    if self.measure == "abs_pearson" and not same_shape:
                        raise UserError(
                            f"LayerCorrelation: the outputs of this {bmap.family} model differ in shape, "
                            "and have no Pearson correlation across stages; use measure linear_cka or auto"
                        )
                    measures["all"] = (
                        self.measure if self.measure != "auto" else "abs_pearson" if same_shape else "linear_cka"
                    )
                    accumulators["all"] = (
                        CorrelationAccumulator() if measures["all"] == "abs_pearson" else LinearCKAAccumulator()
                    )
                accumulators["all"].add(features)
            if "cls" in accumulators:
                accumulators["cls"].add([f[:, 0] for f in features])

        bmap, tap = self.run(trainer, pl_module, consume)
        layers = [label for label, _ in tap.points]
        section: Section = {"family": bmap.family, "layers": layers}
        metrics: dict[str, float] = {}
        for kind in self.tokens:
            corr = accumulators[kind].matrix(len(layers))
            if measures[kind] == "abs_pearson":
                corr = corr.abs()  # the paper plots |rho| (App. F)
            section[kind] = _nullable(corr)
            adjacent = [corr[i, i + 1].item() for i in range(len(layers) - 1) if not math.isnan(corr[i, i + 1])]
            if adjacent:
                metrics[f"{kind}/mean_adjacent"] = sum(adjacent) / len(adjacent)
            if len(layers) > 1 and not math.isnan(corr[0, -1]):
                metrics[f"{kind}/first_last"] = corr[0, -1].item()
        section["measures"] = {kind: measures[kind] for kind in self.tokens}
        section["protocol"] = {
            "follows": "paper",
            "reference": "Bhojanapalli et al. 2021, Sec. 4 and App. F (Figs. 7, 31-33); no public code",
            "differences": [
                (
                    "how the paper pools the Pearson correlation is not stated: here over images x tokens "
                    "x channels (one pair of long vectors per layer pair)"
                ),
                (
                    "linear CKA is estimated over batches with the unbiased HSIC (Nguyen et al. 2021), "
                    "not on all images' Gram matrix at once"
                ),
            ],
        }
        section["conditions"] = {
            "arch": pl_module.hparams.get("arch"),
            "tokens": self.tokens,
            "measure": self.measure,
            "abs_pearson": "|Pearson correlation| over images x tokens x channels (float64 sums)",
            "linear_cka": "minibatch linear CKA, features flattened per image",
        }
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> Figure:
        """Bhojanapalli et al.'s Fig. 7 (Figs. 31-33): one heatmap per token set, "All tokens" (left) and "CLS token"
        (right), blocks on both axes (1 = first; E: the patch embedding), white for 0 to dark blue for |ρ| = 1
        (linear CKA for ResNet-like stages, Fig. 33)."""
        kinds = [k for k in ("all", "cls") if k in section["measures"]]
        fig, axes = new_figure(1, len(kinds), figsize=(5.5 * len(kinds), 4.5), squeeze=False)
        layers = section["layers"]
        names = ["E" if name == "stem" else str(i + (layers[0] != "stem")) for i, name in enumerate(layers)]
        for ax, kind in zip(axes[0], kinds):
            matrix = torch.tensor([[float("nan") if v is None else v for v in row] for row in section[kind]])
            image = ax.imshow(matrix.numpy(), vmin=0, vmax=1, cmap="Blues")  # as the paper: white 0, dark blue 1
            step = max(1, len(names) // 12)
            ticks = list(range(0, len(names), step))
            ax.set_xticks(ticks, [names[i] for i in ticks])
            ax.set_yticks(ticks, [names[i] for i in ticks])
            ax.set_xlabel("Block")
            ax.set_ylabel("Block")
            ax.set_title("All tokens" if kind == "all" else "CLS token")
            bar = fig.colorbar(image, ax=ax, fraction=0.046)
            bar.set_label("|ρ|" if section["measures"][kind] == "abs_pearson" else "Linear CKA")
        fig.suptitle(model_label(section["conditions"].get("arch")))
        fig.tight_layout()
        return fig


VARIANCE_PROTOCOLS = {
    # Park & Kim 2022, Fig. 9: each image's maps, their spatial variance, averaged over channels and images
    "parkkim": "github.com/xxxnell/how-do-vits-work, featuremap_variance.ipynb (Park & Kim 2022, Fig. 9): "
    "latent.var(dim=[-1, -2]).mean(dim=[0, 1])",
    # Chen et al. 2024, Fig. 10: the batch's mean map first (torch.mean(xs, dim=0)), then its spatial variance
    "chen": "github.com/Lauch1ng/LKRobust, feature_map_variance/main.py (Chen et al. 2024, Fig. 10): "
    "latents_item.append(torch.mean(xs, dim=0)), then latent.var(dim=[-1, -2]).mean(dim=[0, 1])",
}


# Which hidden states FeatureVariance reads ("points")
FEATURE_POINTS = ("blocks", "chen")
# The families Chen et al.'s script lists the hidden states of (feature_map_variance/main.py: resnet50, replknet,
# vit_base_patch16_224)
CHEN_FAMILIES = ("replknet", "vit", "resnet")


class FeatureVariance(_FeatureAnalysis):
    """Feature-map variance per block (Park & Kim, Fig. 9; Chen et al., Fig. 10).

    Args:
        sublayers: one point per residual branch (attention / MLP of a transformer block) instead of per block.
        stem: include the stem output as the first point.
        protocol: "parkkim": the spatial variance of each image's maps, averaged over channels and images (Park
            & Kim's notebook); "chen": the spatial variance of the batch's mean map, averaged over channels and
            batches (Chen et al.'s script averages each batch's maps over the images first).
        points: "blocks": the stem and each unit (each branch with ``sublayers``); "chen": the list of Chen et
            al.'s script (github.com/Lauch1ng/LKRobust, feature_map_variance/main.py) for the three families it
            knows, ``sublayers`` and ``stem`` unused: RepLKNet each stem layer, each RepLK block and ConvFFN and
            each transition layer, its last entry dropped as the script drops it (57 points on RepLKNet-31B); ViT
            the patch embedding and the residual stream after each attention and MLP branch; ResNet the stem and
            each block.
        sweeps: with protocol "chen", None: every batch of the images, in their order, counts once; N: the
            script's batches, N random permutations of the images (torch seed 0, as the script draws them) of
            which the last batch of ``batch_size`` each counts (the script: 10 sweeps, 1280 images, 128 a batch).
        interpolation: the resize filter (see Analysis): Chen et al.'s script resizes bilinearly.
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "feature_variance"

    def __init__(
        self,
        sublayers: bool = True,
        stem: bool = True,
        protocol: str = "parkkim",
        points: str = "blocks",
        sweeps: int | None = None,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
        interpolation: str | None = None,
    ):
        super().__init__(sublayers, stem, max_images, batch_size, weights, plot, interpolation)
        if protocol not in VARIANCE_PROTOCOLS:
            raise UserError(
                f"FeatureVariance.protocol must be one of {', '.join(VARIANCE_PROTOCOLS)}, got {protocol!r}"
            )
        if points not in FEATURE_POINTS:
            raise UserError(f"FeatureVariance.points must be one of {', '.join(FEATURE_POINTS)}, got {points!r}")
        if sweeps is not None and (sweeps < 1 or protocol != "chen"):
            raise UserError(
                f"FeatureVariance.sweeps draws the batches of Chen et al.'s script: a positive number with "
                f"protocol chen, got {sweeps!r} with protocol {protocol!r}"
            )
        self.protocol, self.points, self.sweeps = protocol, points, sweeps

    def check(self, trainer: Trainer, pl_module: AnalysedModule) -> None:
        bmap = find_blocks(pl_module.model.net)
        if self.points == "chen" and bmap.family not in CHEN_FAMILIES:
            raise UserError(
                f"FeatureVariance.points 'chen' lists the hidden states as Chen et al.'s script does for "
                f"{', '.join(CHEN_FAMILIES)} models; this is a {bmap.family} model, so it does not apply: "
                "set points: blocks"
            )

    def tap(self, net: nn.Module, bmap: BlockMap) -> FeatureTap:
        if self.points == "blocks":
            return super().tap(net, bmap)
        return FeatureTap(net, bmap, sublayers=True, stem=True, layers=bmap.family == "replknet")

    def drops_last(self, bmap: BlockMap) -> bool:
        """Chen et al.'s script drops the last entry of its list, meant for the logits; RepLKNet's list has no head,
        so there it drops the last ConvFFN (ViT's and ResNet's lists end in the head, which no tap reads)."""
        return self.points == "chen" and bmap.family == "replknet"

    def script_batches(self, trainer: Trainer, pl_module: AnalysedModule) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batches Chen et al.'s script keeps: of each of ``sweeps`` random permutations of the images, the
        last batch. The script seeds torch's global generator with 0 just before drawing its permutations, the
        same draws as a generator seeded with 0."""
        images, labels = self.images(trainer, pl_module)
        generator = torch.Generator().manual_seed(0)
        last = (len(images) - 1) // self.batch_size * self.batch_size  # where a sweep's last batch starts
        batches = []
        assert self.sweeps is not None  # called with sweeps only
        for _ in range(self.sweeps):
            index = torch.randperm(len(images), generator=generator)[last:].to(images.device)
            batches.append((images[index], labels[index]))
        return batches

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        totals: list[float] = []
        sizes: list[tuple[int, ...]] = []
        count = [0]

        def consume(bmap: BlockMap, features: list[torch.Tensor], image_hw: tuple[int, int]) -> None:
            maps = [as_map(f, bmap, image_hw) for f in (features[:-1] if self.drops_last(bmap) else features)]
            if self.protocol == "chen":  # one mean map per batch
                maps = [m.float().mean(dim=0, keepdim=True) for m in maps]
            values = [feature_variance(m) for m in maps]
            if not totals:
                totals.extend([0.0] * len(values))
                sizes.extend(tuple(m.shape[-2:]) for m in maps)
            for i, v in enumerate(values):
                totals[i] += float(v.sum())
            count[0] += len(values[0])

        batches = self.script_batches(trainer, pl_module) if self.sweeps else None
        bmap, tap = self.run(trainer, pl_module, consume, batches)
        means = [t / count[0] for t in totals]
        variances = [None if math.isnan(v) else v for v in means]  # a 1x1 map has no spatial variance
        points = [
            {"name": label, "kind": kind, "map_size": list(size), "subsampling": sub, "variance": v}
            for (label, kind), size, sub, v in zip(tap.points, sizes, _subsampling(sizes), variances)
        ]
        differences = []
        if self.protocol == "chen" and not self.sweeps:
            differences.append(
                "the script keeps the mean map of the last batch of each of its 10 sweeps over random "
                "permutations of its 1280 images (sweeps: 10); here every batch's mean map counts, the "
                "images in their order"
            )
        if self.protocol == "chen" and self.points != "chen":
            differences.append(
                "the points are the stem and each unit (or branch), not the script's list (points: chen), "
                "which on RepLKNet taps each stem layer, RepLK block, ConvFFN and transition layer"
            )
        section = {
            "family": bmap.family,
            "points": points,
            "protocol": {
                "follows": "code",
                "reference": VARIANCE_PROTOCOLS[self.protocol],
                "differences": differences,
            },
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "sublayers": self.sublayers if self.points == "blocks" else None,  # the script's list: unused
                "points": self.points,
                "protocol": self.protocol,
                "sweeps": self.sweeps,
                "measure": "unbiased spatial variance per channel, mean over channels and "
                + ("images" if self.protocol == "parkkim" else "batches, of each batch's mean map"),
            },
        }
        known = [v for v in variances if v is not None]
        metrics = {"last": known[-1], "max": max(known)} if known else {}
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> Figure:
        """Park & Kim's Fig. 9: "Feature map variance" against "Normalized depth", MSAs gray, subsampling blue."""
        fig, ax = new_figure(figsize=(6.5, 4))
        depth_axis(ax, section["points"], "variance", section["conditions"].get("arch"))
        ax.set_ylim(bottom=0.0)
        ax.set_ylabel("Feature map variance")
        fig.tight_layout()
        return fig


class FourierFeatures(_FeatureAnalysis):
    """Relative log amplitude of Fourier-transformed feature maps (Park & Kim, Figs. 2a and 8).

    Args:
        sublayers: one point per residual branch (attention / MLP of a transformer block) instead of per block.
        stem: include the stem output as the first point.
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "fourier_features"

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        totals: list[torch.Tensor] = []
        frequencies: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        sizes: list[tuple[int, ...]] = []
        count = [0]

        def consume(bmap: BlockMap, features: list[torch.Tensor], image_hw: tuple[int, int]) -> None:
            for i, f in enumerate(features):
                maps = as_map(f, bmap, image_hw)
                _, relative = relative_log_amplitude(maps)
                if len(totals) <= i:
                    totals.append(torch.zeros(relative.shape[1], dtype=torch.float64))
                    frequencies.append(fourier_grid(min(maps.shape[-2:])))
                    sizes.append(tuple(maps.shape[-2:]))
                totals[i] += relative.double().sum(dim=0).cpu()
            count[0] += len(features[0])

        bmap, tap = self.run(trainer, pl_module, consume)
        points: list[Section] = []
        for (label, kind), total, (bins, plotted, true), size, sub in zip(
            tap.points, totals, frequencies, sizes, _subsampling(sizes)
        ):
            curve = (total / count[0]).tolist()
            points.append(
                {
                    "name": label,
                    "kind": kind,
                    "map_size": list(size),
                    "subsampling": sub,
                    "frequencies": plotted.tolist(),
                    "dft_bins": bins,
                    "dft_frequencies": true.tolist(),
                    "relative_log_amplitude": curve,
                    # a 1x1 map has only frequency 0: no high-frequency value
                    "high_frequency": curve[-1] if len(curve) > 1 else None,
                }
            )
        section: Section = {
            "family": bmap.family,
            "points": points,
            "protocol": {
                "follows": "code",
                "reference": "github.com/xxxnell/how-do-vits-work, "
                "fourier_analysis.ipynb (Park & Kim 2022, Figs. 2a and 8)",
                "differences": [
                    (
                        "the paper (App. A) reports the amplitude at f = pi; the code's "
                        "last point, followed here, is the diagonal bin ceil(n/2) - 1 (true "
                        "frequency 2k/n, e.g. 6/7 pi on 14x14), plotted at 1.0 pi"
                    )
                ],
            },
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "sublayers": self.sublayers,
                "measure": f"log(|FFT2| + {LOG_EPS}) averaged over channels and images, at the "
                "diagonal bins (k, k), k = 0 .. ceil(n/2) - 1, minus its value at "
                "frequency 0",
                "frequencies": "the code's plotting axis linspace(0, 1, K), units of pi; "
                "dft_frequencies: the true frequency 2k/n of each bin along "
                "each axis",
            },
        }
        known = [p["high_frequency"] for p in points if p["high_frequency"] is not None]
        metrics = {"last_high_frequency": known[-1]} if known else {}
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> Figure:
        """Park & Kim's Fig. 2a (left: "Δ Log amplitude" against "Frequency", 0.0π to 1.0π, one curve per point
        coloured by "Normalized depth", plasma) and Fig. 8 (right: the value at 1.0π against "Normalized depth",
        MSAs gray, subsampling blue), as their fourier_analysis.ipynb draws them."""
        import matplotlib  # noqa: PLC0415

        points, arch = section["points"], section["conditions"].get("arch")
        fig, (left, right) = new_figure(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 1.6]})
        cmap, depth = matplotlib.colormaps["plasma"], max(len(points) - 1, 1)
        for i, p in reversed(list(enumerate(points))):  # early (dark) curves on top, as the paper
            if p["high_frequency"] is not None:
                left.plot(p["frequencies"], p["relative_log_amplitude"], color=cmap(i / depth))
        left.set_xlim(0, 1)
        pi_axis(left.xaxis)
        left.set_xlabel("Frequency")
        left.set_ylabel("Δ Log amplitude")
        left.set_title(model_label(arch))
        scale = matplotlib.cm.ScalarMappable(norm=matplotlib.colors.Normalize(0.0, 1.0), cmap=cmap)
        fig.colorbar(scale, ax=left, fraction=0.05).set_label("Normalized depth")
        depth_axis(right, points, "high_frequency", arch, colour_by_depth=True)
        right.set_ylabel("Δ Log amplitude")
        fig.tight_layout()
        return fig
