"""Restricted attention (Bhojanapalli et al. 2021): how much a ViT needs attention between distant patches.

Local masks: a patch token may attend only to patches within ``distance`` of itself along each axis
(|dy| <= d and |dx| <= d on the patch grid: a (2d + 1) x (2d + 1) square, as in the paper's App. A, "mask out
pairs whose distance along the x- or y- axis is greater than the restricted distance"); the CLS (and register)
tokens are always allowed, both as queries and as keys. Control: the same mask under one random but fixed
permutation of the patch positions (rows and columns permuted alike; "a random (but fixed across experiments)
permutation of the mask matrix", Sec. 4), which keeps the number of allowed pairs (and each token's count) but
not their locality. The same permutation serves every distance, block and image. CLS-only attention: in the
first or the last k blocks, patch tokens attend only to the CLS (prefix) tokens, i.e. no patch-to-patch attention.

Masks go into timm's attention (``attn_mask``, boolean, True = allowed) through a wrapper put around each
block's ``attn`` for the duration of a measurement. ViTs only: a ConvNet has no attention to restrict.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning import Trainer
from torch import nn

from robust_lightning.analysis.blocks import BlockMap, find_blocks, replace_module, token_grid
from robust_lightning.analysis.core import AnalysedModule, Analysis, AnalysisResult, Section, model_label, new_figure
from robust_lightning.console import tqdm
from robust_lightning.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "MaskedAttention",
    "RestrictedAttention",
    "allowed_patch_pairs",
    "cls_only_mask",
    "local_mask",
    "masked",
    "patch_permutation",
    "permuted_mask",
]


def local_mask(grid: tuple[int, int], num_prefix: int, distance: float) -> torch.Tensor:
    """(N, N) boolean mask, N = num_prefix + h * w: patches at most ``distance`` apart along each axis
    (Chebyshev distance), prefix tokens free."""
    h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    coords = torch.stack([rows.flatten(), cols.flatten()], dim=1).double()
    near = torch.cdist(coords, coords, p=float("inf")) <= distance  # max(|dy|, |dx|); inf: every pair
    n = num_prefix + h * w
    mask = torch.ones(n, n, dtype=torch.bool)
    mask[num_prefix:, num_prefix:] = near
    return mask


def patch_permutation(patches: int, seed: int) -> torch.Tensor:
    """The one random but fixed permutation of ``patches`` patch positions drawn from ``seed``."""
    return torch.randperm(patches, generator=torch.Generator().manual_seed(seed))


def permuted_mask(mask: torch.Tensor, num_prefix: int, permutation: torch.Tensor) -> torch.Tensor:
    """``mask`` with its patch positions permuted by ``permutation`` (same permutation for queries and keys)."""
    patches = mask.shape[0] - num_prefix
    if sorted(permutation.tolist()) != list(range(patches)):
        raise UserError(f"a permutation of {patches} patch positions is needed, got {len(permutation)} entries")
    order = torch.cat([torch.arange(num_prefix), num_prefix + permutation])
    return mask[order][:, order]


def allowed_patch_pairs(mask: torch.Tensor, num_prefix: int) -> int:
    """Query-key pairs of patch tokens (prefix tokens left out) that ``mask`` allows."""
    return int(mask[num_prefix:, num_prefix:].sum())


def cls_only_mask(grid: tuple[int, int], num_prefix: int) -> torch.Tensor:
    """Patch tokens attend only to the prefix (CLS) tokens; the prefix tokens attend to everything."""
    n = num_prefix + grid[0] * grid[1]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:num_prefix] = True
    mask[:, :num_prefix] = True
    return mask


class MaskedAttention(nn.Module):
    """A timm attention module that always applies a fixed boolean mask."""

    def __init__(self, inner: nn.Module, mask: torch.Tensor):
        super().__init__()
        self.inner, self.mask = inner, mask

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if x.shape[1] != self.mask.shape[0]:
            raise UserError(f"an attention mask for {self.mask.shape[0]} tokens met {x.shape[1]} tokens")
        out: torch.Tensor = self.inner(x, attn_mask=self.mask)
        return out


@contextmanager
def masked(net: nn.Module, bmap: BlockMap, masks: dict[int, torch.Tensor]) -> Iterator[nn.Module]:
    """``net`` with the attention of unit i masked by ``masks[i]`` (on the net's device), restored on exit."""
    device = next(net.parameters()).device
    done = []
    try:
        for i, mask in masks.items():
            path = bmap.units[i].attention
            assert path is not None  # masks are given for attention units only
            done.append((path, replace_module(net, path, MaskedAttention(net.get_submodule(path), mask.to(device)))))
        yield net
    finally:
        for path, old in reversed(done):
            replace_module(net, path, old)


def _distance_key(d: float) -> int | str:
    return int(d) if math.isfinite(d) else "inf"


class RestrictedAttention(Analysis):
    """Accuracy of a ViT under restricted attention.

    Args:
        distances: maximum distances along each axis (whole patches, >= 0; .inf = unrestricted) of the local masks.
        permutations: 1: also measure each local mask under the one random but fixed permutation (the control);
            0: no control. The paper uses one permutation; more than one is refused (draw another with ``seed``).
        blocks: blocks whose attention the local masks restrict (0-based); null: every block.
        cls_only: numbers k of first / last blocks whose patch tokens attend only to the CLS token ([] for none).
        seed: seed of the permutation.
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "restricted_attention"

    def __init__(
        self,
        distances: Sequence[float] = (0, 1, 2, 3, 4, 6, 8, 12),
        permutations: int = 1,
        blocks: list[int] | None = None,
        cls_only: Sequence[int] = (1, 2, 4, 6),
        seed: int = 0,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if any(d < 0 for d in distances) or any(k < 1 for k in cls_only):
            raise UserError("RestrictedAttention: distances must be >= 0 and cls_only entries >= 1")
        fractional = [d for d in distances if math.isfinite(d) and d != int(d)]
        if fractional:
            raise UserError(
                f"RestrictedAttention.distances {fractional}: the distance along each axis is a whole "
                "number of patches (the paper's square neighbourhoods); use integers or .inf"
            )
        if permutations not in (0, 1):
            raise UserError(
                f"RestrictedAttention.permutations {permutations}: the control is one random but fixed "
                "permutation of the mask (Bhojanapalli et al.), so permutations is 1 (or 0: no control); "
                "run again with another seed for another permutation"
            )
        self.distances, self.permutations = sorted(float(d) for d in distances), permutations
        self.blocks, self.cls_only, self.seed = blocks, sorted(set(cls_only)), seed

    def check(self, trainer: Trainer, pl_module: AnalysedModule) -> None:
        bmap = find_blocks(pl_module.model.net)
        bmap.require_attention("RestrictedAttention")
        if self.cls_only:
            bmap.require_cls("RestrictedAttention.cls_only")
        depth = len(bmap.units)
        if any(k > depth for k in self.cls_only) or any(not 0 <= b < depth for b in self.blocks or []):
            raise UserError(
                f"RestrictedAttention: the model has {depth} blocks; cls_only {self.cls_only} and "
                f"blocks {self.blocks} must fit in them"
            )

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        images, labels = self.images(trainer, pl_module)
        model = copy.deepcopy(self.model(pl_module))  # masks wrap modules of this copy only
        net: Any = model.net  # a timm ViT (blocks)
        bmap = find_blocks(net)
        seen: dict[str, int] = {}
        hook = net.blocks[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("n", args[0].shape[1]))
        with torch.no_grad():
            model(images[:1])
        hook.remove()
        prefix = bmap.num_prefix_tokens
        grid = token_grid(seen["n"] - prefix, (images.shape[-2], images.shape[-1]))
        depth = len(bmap.units)
        targets = range(depth) if self.blocks is None else self.blocks
        patches = grid[0] * grid[1]
        permutation = patch_permutation(patches, self.seed)

        total = (
            1
            + sum(1 + self.permutations * (not local_mask(grid, prefix, d).all()) for d in self.distances)
            + 2 * len(self.cls_only)
        )
        with tqdm(total=total, desc="restricted attention", disable=not trainer.is_global_zero, leave=False) as bar:

            def measure(masks: dict[int, torch.Tensor]) -> float:
                with masked(net, bmap, masks):
                    acc = self.accuracy(model, images, labels)
                bar.update()
                return acc

            full = measure({})
            rows: list[Section] = []
            for d in self.distances:
                mask = local_mask(grid, prefix, d)
                local = measure({i: mask for i in targets})
                # a mask that allows every pair is its own permutation: nothing to compare
                permuted = None
                if self.permutations and not mask.all():
                    permuted = {"accuracy": measure({i: permuted_mask(mask, prefix, permutation) for i in targets})}
                pairs = allowed_patch_pairs(mask, prefix)
                rows.append(
                    {
                        "distance": _distance_key(d),
                        "allowed_pairs": int(mask.sum()),
                        "allowed_patch_pairs": pairs,
                        "allowed_fraction": pairs / patches**2,
                        "local_accuracy": local,
                        "permuted": permuted,
                    }
                )
            cls_rows: dict[str, list[Section]] = {"first": [], "last": []}
            if self.cls_only:
                only = cls_only_mask(grid, prefix)
                for k in self.cls_only:
                    cls_rows["first"].append({"k": k, "accuracy": measure({i: only for i in range(k)})})
                    cls_rows["last"].append({"k": k, "accuracy": measure({i: only for i in range(depth - k, depth)})})
        section = {
            "family": bmap.family,
            "grid": list(grid),
            "num_prefix_tokens": prefix,
            "full_accuracy": full,
            "local": rows,
            "cls_only": cls_rows,
            "permutation": permutation.tolist() if self.permutations else None,
            "protocol": {
                "follows": "paper",
                "reference": "Bhojanapalli et al. 2021, Sec. 4 and App. A (Fig. 9); no public code",
                "differences": [],
            },
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "blocks": list(targets),
                "permutations": self.permutations,
                "seed": self.seed,
                "distance": "max(|dy|, |dx|) on the patch grid (square neighbourhood); prefix (CLS) tokens "
                "always allowed; allowed_fraction: allowed patch-patch pairs / patches^2",
                "cls_only": "patch tokens attend only to the prefix tokens in the first / last k blocks",
            },
        }
        metrics: dict[str, float] = {"full_accuracy": full}
        for row in rows:
            metrics[f"local_{row['distance']}"] = row["local_accuracy"]
            if row["permuted"]:
                metrics[f"permuted_{row['distance']}"] = row["permuted"]["accuracy"]
        for where, entries in cls_rows.items():
            for entry in entries:
                metrics[f"cls_only_{where}_{entry['k']}"] = entry["accuracy"]
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> Figure:
        """Bhojanapalli et al.'s Fig. 9. Left: "Accuracy (%)" against the "Maximum distance (patches)" allowed
        between attending patches, the model's solid line and, dashed, its "random permutation" of the same mask.
        Right: patch tokens attend only to CLS in the first ("Beginning") or last ("End") k blocks, against the
        "Number of blocks". The dotted line is the unrestricted model."""
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

        label = model_label(section["conditions"].get("arch"))
        fig, (left, right) = new_figure(1, 2, figsize=(11, 4))
        rows = [r for r in section["local"] if r["distance"] != "inf"]
        line = left.plot(
            [r["distance"] for r in rows], [100 * r["local_accuracy"] for r in rows], marker="o", label=label
        )[0]
        perm = [r for r in rows if r["permuted"]]
        if perm:
            left.plot(
                [r["distance"] for r in perm],
                [100 * r["permuted"]["accuracy"] for r in perm],
                marker="s",
                linestyle="--",
                color=line.get_color(),
                label=f"{label}, random permutation",
            )
        left.axhline(100 * section["full_accuracy"], color="gray", linestyle=":", label="No restriction")
        left.set_xlabel("Maximum distance (patches)")
        left.set_ylabel("Accuracy (%)")
        left.set_title(f"Restricted attention ({section['grid'][0]}x{section['grid'][1]} patches)", fontsize=10)
        left.legend(fontsize=8)
        for where, name in (("first", "Beginning"), ("last", "End")):
            entries = section["cls_only"].get(where)
            if entries:
                right.plot([e["k"] for e in entries], [100 * e["accuracy"] for e in entries], marker="o", label=name)
        right.axhline(100 * section["full_accuracy"], color="gray", linestyle=":", label="No restriction")
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_xlabel("Number of blocks")
        right.set_ylabel("Accuracy (%)")
        right.set_title(f"Attention only between patches and CLS: {label}", fontsize=10)
        right.legend(fontsize=8)
        fig.tight_layout()
        return fig
