"""Restricted attention (Bhojanapalli et al. 2021): how much a ViT needs attention between distant patches.

Local masks: a patch token may attend only to patches within ``distance`` (Euclidean, in patches) of itself;
the CLS (and register) tokens are always allowed, both as queries and as keys. Control: the same mask under a
random permutation of the patch positions (rows and columns permuted alike), which keeps the number of allowed
pairs (and each token's count) but not their locality. CLS-only attention: in the first or the last k blocks,
patch tokens attend only to the CLS (prefix) tokens, i.e. no patch-to-patch attention at all.

Masks go into timm's attention (``attn_mask``, boolean, True = allowed) through a wrapper put around each
block's ``attn`` for the duration of a measurement. ViTs only: a ConvNet has no attention to restrict.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from tqdm import tqdm

from robust_lightning.analysis.base import Analysis, new_figure
from robust_lightning.analysis.blocks import BlockMap, find_blocks, replace_module, token_grid
from robust_lightning.analysis.lesion import summary
from robust_lightning.errors import UserError

__all__ = ["MaskedAttention", "RestrictedAttention", "cls_only_mask", "local_mask", "masked", "permuted_mask"]


def local_mask(grid: tuple[int, int], num_prefix: int, distance: float) -> torch.Tensor:
    """(N, N) boolean mask, N = num_prefix + h * w: patches within ``distance`` of each other, prefix tokens free."""
    h, w = grid
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    coords = torch.stack([rows.flatten(), cols.flatten()], dim=1).double()
    near = torch.cdist(coords, coords) <= distance  # inf: every pair
    n = num_prefix + h * w
    mask = torch.ones(n, n, dtype=torch.bool)
    mask[num_prefix:, num_prefix:] = near
    return mask


def permuted_mask(mask: torch.Tensor, num_prefix: int, generator: torch.Generator) -> torch.Tensor:
    """``mask`` with its patch positions randomly permuted (same permutation for queries and keys)."""
    patches = mask.shape[0] - num_prefix
    order = torch.cat([torch.arange(num_prefix), num_prefix + torch.randperm(patches, generator=generator)])
    return mask[order][:, order]


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

    def forward(self, x, attn_mask=None, is_causal: bool = False):
        if x.shape[1] != self.mask.shape[0]:
            raise UserError(f"an attention mask for {self.mask.shape[0]} tokens met {x.shape[1]} tokens")
        return self.inner(x, attn_mask=self.mask)


@contextmanager
def masked(net: nn.Module, bmap: BlockMap, masks: dict[int, torch.Tensor]) -> Iterator[nn.Module]:
    """``net`` with the attention of unit i masked by ``masks[i]`` (on the net's device), restored on exit."""
    device = next(net.parameters()).device
    done = []
    try:
        for i, mask in masks.items():
            path = bmap.units[i].attention
            done.append((path, replace_module(net, path, MaskedAttention(net.get_submodule(path), mask.to(device)))))
        yield net
    finally:
        for path, old in reversed(done):
            replace_module(net, path, old)


def _distance_key(d: float) -> float | str:
    return d if math.isfinite(d) else "inf"


class RestrictedAttention(Analysis):
    """Accuracy of a ViT under restricted attention.

    Args:
        distances: radii (in patches, Euclidean; .inf = unrestricted) of the local masks.
        permutations: random permutations of each local mask (the control).
        blocks: blocks whose attention the local masks restrict (0-based); null: every block.
        cls_only: numbers k of first / last blocks whose patch tokens attend only to the CLS token ([] for none).
        seed: seed of the permutations.
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "restricted_attention"

    def __init__(self, distances: list[float] = (0, 1, 1.5, 2, 3, 4, 6, 8), permutations: int = 3,
                 blocks: list[int] | None = None, cls_only: list[int] = (1, 2, 4, 6), seed: int = 0,
                 max_images: int = 256, batch_size: int = 64, weights: str = "raw", plot: bool = True):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if any(d < 0 for d in distances) or permutations < 0 or any(k < 1 for k in cls_only):
            raise UserError("RestrictedAttention: distances must be >= 0, permutations >= 0, cls_only entries >= 1")
        self.distances, self.permutations = sorted(float(d) for d in distances), permutations
        self.blocks, self.cls_only, self.seed = blocks, sorted(set(cls_only)), seed

    def check(self, trainer, pl_module) -> None:
        bmap = find_blocks(pl_module.model.net)
        bmap.require_attention("RestrictedAttention")
        if self.cls_only:
            bmap.require_cls("RestrictedAttention.cls_only")
        depth = len(bmap.units)
        if any(k > depth for k in self.cls_only) or any(not 0 <= b < depth for b in self.blocks or []):
            raise UserError(f"RestrictedAttention: the model has {depth} blocks; cls_only {self.cls_only} and "
                            f"blocks {self.blocks} must fit in them")

    def analyse(self, trainer, pl_module):
        images, labels = self.images(trainer, pl_module)
        model = copy.deepcopy(self.model(pl_module))  # masks wrap modules of this copy only
        net = model.net
        bmap = find_blocks(net)
        seen = {}
        hook = net.blocks[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("n", args[0].shape[1]))
        with torch.no_grad():
            model(images[:1])
        hook.remove()
        prefix = bmap.num_prefix_tokens
        grid = token_grid(seen["n"] - prefix, tuple(images.shape[-2:]))
        depth = len(bmap.units)
        targets = range(depth) if self.blocks is None else self.blocks
        generator = torch.Generator().manual_seed(self.seed)

        total = 1 + sum(1 + self.permutations * (not local_mask(grid, prefix, d).all()) for d in self.distances) \
            + 2 * len(self.cls_only)
        bar = tqdm(total=total, desc="restricted attention", disable=not trainer.is_global_zero, leave=False)

        def measure(masks: dict[int, torch.Tensor]) -> float:
            with masked(net, bmap, masks):
                acc = self.accuracy(model, images, labels)
            bar.update()
            return acc

        full = measure({})
        rows = []
        for d in self.distances:
            mask = local_mask(grid, prefix, d)
            local = measure({i: mask for i in targets})
            # a mask that allows every pair is its own permutation: nothing to compare
            shuffled = [] if mask.all() else [measure({i: permuted_mask(mask, prefix, generator) for i in targets})
                                              for _ in range(self.permutations)]
            rows.append({"distance": _distance_key(d), "allowed_pairs": int(mask.sum()), "local_accuracy": local,
                         "permuted": summary(shuffled) if shuffled else None})
        cls_rows = {"first": [], "last": []}
        if self.cls_only:
            only = cls_only_mask(grid, prefix)
            for k in self.cls_only:
                cls_rows["first"].append({"k": k, "accuracy": measure({i: only for i in range(k)})})
                cls_rows["last"].append({"k": k, "accuracy": measure({i: only for i in range(depth - k, depth)})})
        bar.close()
        section = {
            "family": bmap.family, "grid": list(grid), "num_prefix_tokens": prefix, "full_accuracy": full,
            "local": rows, "cls_only": cls_rows,
            "conditions": {"arch": pl_module.hparams.get("arch"), "blocks": list(targets), "permutations": self.permutations,
                           "seed": self.seed, "distance": "Euclidean, in patches; prefix (CLS) tokens always allowed",
                           "cls_only": "patch tokens attend only to the prefix tokens in the first / last k blocks"},
        }
        metrics = {"full_accuracy": full}
        for row in rows:
            metrics[f"local_{row['distance']}"] = row["local_accuracy"]
            if row["permuted"]:
                metrics[f"permuted_{row['distance']}"] = row["permuted"]["mean"]
        for where, entries in cls_rows.items():
            for entry in entries:
                metrics[f"cls_only_{where}_{entry['k']}"] = entry["accuracy"]
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section):
        fig, (left, right) = new_figure(1, 2, figsize=(11, 4))
        rows = [r for r in section["local"] if r["distance"] != "inf"]
        xs = [r["distance"] for r in rows]
        left.plot(xs, [100 * r["local_accuracy"] for r in rows], marker="o", label="local mask")
        perm = [r for r in rows if r["permuted"]]
        if perm:
            left.errorbar([r["distance"] for r in perm], [100 * r["permuted"]["mean"] for r in perm],
                          yerr=[[100 * (r["permuted"]["mean"] - r["permuted"]["min"]) for r in perm],
                                [100 * (r["permuted"]["max"] - r["permuted"]["mean"]) for r in perm]],
                          marker="s", capsize=3, label="permuted mask (min-max)")
        left.axhline(100 * section["full_accuracy"], color="gray", linestyle="--", label="full attention")
        left.set_xlabel("attention radius (patches)")
        left.set_ylabel("top-1 accuracy (%)")
        left.set_title(f"Local vs permuted attention masks (grid {section['grid'][0]}x{section['grid'][1]})")
        left.legend(fontsize=8)
        for where, entries in section["cls_only"].items():
            if entries:
                right.plot([e["k"] for e in entries], [100 * e["accuracy"] for e in entries], marker="o",
                           label=f"{where} k blocks")
        right.axhline(100 * section["full_accuracy"], color="gray", linestyle="--", label="full attention")
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

        right.xaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_xlabel("k (blocks with CLS-only attention)")
        right.set_ylabel("top-1 accuracy (%)")
        right.set_title("Patch tokens attend only to CLS")
        right.legend(fontsize=8)
        fig.tight_layout()
        return fig
