"""Lesion study (Bhojanapalli et al. 2021, Fig. 8; Chen et al. 2024 for RepLKNet): accuracy when residual units
are removed at inference, so information flows through their skip connections.

Cases: each unit removed on its own ("block"), and, where units have parts, only one part of it (the attention
or the MLP branch of a transformer block; the large-kernel block or the FFN of a RepLKNet pair); then n units
drawn at random and removed together, ``samples`` draws per n (mean, standard error, min and max), "always
keeping the first block" (Bhojanapalli et al., Fig. 8): the first unit of the network is never drawn. A
ConvNeXt or ResNet block has one residual branch, so it has no parts: asking for an attention-only lesion of
one is refused. Chen et al.'s RepLKNet protocol (one random stage-3 block pair, 10 draws) is
``random_counts: [1], samples: 10, random_stages: [2]``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning import Trainer

from robust_lightning.analysis.blocks import BlockMap, find_blocks, lesioned, removable_units
from robust_lightning.analysis.core import AnalysedModule, Analysis, AnalysisResult, Section, model_label, new_figure
from robust_lightning.console import tqdm
from robust_lightning.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["LesionStudy", "summary"]

FIGURES = ("bhojanapalli", "chen")
# what the papers call the removed parts (Bhojanapalli et al., Fig. 8: "block, self-attention or MLP"; Chen et al.:
# RepLKNet's large-kernel block and its FFN)
PART_NAMES = {"block": "Block", "attention": "Self-Attention", "mlp": "MLP", "large_kernel": "Large kernel"}


def summary(values: list[float]) -> dict[str, Any]:
    """Mean, standard error of the mean, min and max of repeated measurements."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {
        "mean": mean,
        "stderr": math.sqrt(var / n),
        "min": min(values),
        "max": max(values),
        "samples": n,
        "accuracies": list(values),
    }


class LesionStudy(Analysis):
    """Accuracy with residual units (or their parts) removed.

    Args:
        modes: single-unit lesions to run: "block" and/or part names ("attention", "mlp", "large_kernel").
            null: "block" and every part the model has. A part the model does not have is refused.
        random_counts: numbers n of units removed together at random (e.g. [2, 4, 6]); [] for none.
        samples: random draws per n (Bhojanapalli et al. 25, Chen et al. 10).
        random_parts: what the random lesions remove, one curve each: "block" and/or part names; null: "block"
            and every part the model has (Bhojanapalli et al.'s Fig. 8 bottom row: block, attention and MLP). The
            same draws of n units serve every part.
        random_stages: draw only among units of these stages (0-based; RepLKNet's stage 3 is 2); null: all units.
        seed: seed of the random draws.
        figure: whose figure lesion.png follows: "bhojanapalli" (Fig. 8: accuracy against the removed block and
            against the number n of blocks removed, mean with standard-error bars and min/max shaded) or "chen"
            (Chen et al.'s Fig. 7: against the proportion of blocks dropped, mean line and min/max shaded).
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "lesion"

    def __init__(
        self,
        modes: list[str] | None = None,
        random_counts: Sequence[int] = (2, 4, 6),
        samples: int = 25,
        random_parts: Sequence[str] | None = ("block",),
        random_stages: list[int] | None = None,
        seed: int = 0,
        figure: str = "bhojanapalli",
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if samples < 1 or any(n < 1 for n in random_counts):
            raise UserError("LesionStudy: samples and every random_counts entry must be positive")
        if random_parts is not None and not random_parts:
            raise UserError("LesionStudy.random_parts is empty: name 'block' and/or parts, or null for all")
        self.modes = None if modes is None else list(modes)
        self.random_counts, self.samples = sorted(set(random_counts)), samples
        self.random_parts = None if random_parts is None else list(dict.fromkeys(random_parts))
        self.random_stages, self.seed = random_stages, seed
        if figure not in FIGURES:
            raise UserError(f"LesionStudy.figure must be one of {', '.join(FIGURES)}, got {figure!r}")
        self.figure_layout = figure

    def parts_drawn(self, bmap: BlockMap) -> list[str]:
        """What the random lesions remove: ``random_parts``, or "block" and every part of the model."""
        return self.random_parts if self.random_parts is not None else ["block", *bmap.part_names()]

    def check(self, trainer: Trainer, pl_module: AnalysedModule) -> None:
        bmap = find_blocks(pl_module.model.net)
        parts = bmap.part_names()
        random_parts = self.parts_drawn(bmap)
        for mode in [*(self.modes or []), *random_parts]:
            if mode != "block" and mode not in parts:
                raise UserError(
                    f"LesionStudy: a {bmap.family} model has no {mode!r} branch to remove on its own "
                    f"(its units have: {', '.join(['block', *parts])}); the {mode} lesion does not apply to it"
                )
        if self.random_stages is not None:
            stages = sorted({u.stage for u in bmap.units})
            if not set(self.random_stages) <= set(stages):
                raise UserError(f"LesionStudy.random_stages {self.random_stages}: the model has stages {stages}")
        pool = [
            u
            for u in bmap.units[1:]
            if (self.random_stages is None or u.stage in self.random_stages)
            and all(part == "block" or part in u.parts for part in random_parts)
        ]
        too_many = [n for n in self.random_counts if n > len(pool)]
        if too_many:
            raise UserError(
                f"LesionStudy.random_counts {too_many}: this {bmap.family} model has only {len(pool)} "
                "units to draw from (the first block is always kept)"
            )

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        images, labels = self.images(trainer, pl_module)
        model = copy.deepcopy(self.model(pl_module))  # lesions swap modules of this copy only
        net = model.net
        bmap = find_blocks(net)
        units, fixed = removable_units(net, bmap, model.normalize(images[:1]))
        modes = self.modes if self.modes is not None else ["block", *bmap.part_names()]
        # random lesions always keep the first block (Bhojanapalli et al., Fig. 8)
        pool = [
            u
            for u in units
            if u.name != bmap.units[0].name and (self.random_stages is None or u.stage in self.random_stages)
        ]
        random_parts = self.parts_drawn(bmap)
        pool = [u for u in pool if all(part == "block" or part in u.parts for part in random_parts)]
        too_many = [n for n in self.random_counts if n > len(pool)]
        if too_many:
            raise UserError(
                f"LesionStudy.random_counts {too_many}: only {len(pool)} units can be drawn from (the "
                "first block is always kept)"
            )

        cases = [(mode, [u]) for mode in modes for u in units if mode == "block" or mode in u.parts]
        generator = torch.Generator().manual_seed(self.seed)
        draws = [
            (n, [pool[i] for i in sorted(torch.randperm(len(pool), generator=generator)[:n].tolist())])
            for n in self.random_counts
            for _ in range(self.samples)
        ]
        with tqdm(
            total=1 + len(cases) + len(draws) * len(random_parts),
            desc="lesion",
            disable=not trainer.is_global_zero,
            leave=False,
        ) as bar:
            intact = self.accuracy(model, images, labels)
            bar.update()
            single: dict[str, list[Section]] = {mode: [] for mode in modes}
            for mode, (unit,) in cases:
                with lesioned(net, [unit], mode):
                    single[mode].append(
                        {"unit": unit.name, "stage": unit.stage, "accuracy": self.accuracy(model, images, labels)}
                    )
                bar.update()
            random: dict[str, dict[str, Section]] = {}  # part -> n -> draws
            for part in random_parts:
                for n, chosen in draws:
                    with lesioned(net, chosen, part):
                        acc = self.accuracy(model, images, labels)
                    entry = random.setdefault(part, {}).setdefault(str(n), {"accuracies": [], "removed": []})
                    entry["accuracies"].append(acc)
                    entry["removed"].append([u.name for u in chosen])
                    bar.update()
        random = {
            part: {n: {**summary(e["accuracies"]), "removed": e["removed"]} for n, e in by_n.items()}
            for part, by_n in random.items()
        }

        section = {
            "family": bmap.family,
            "units": [u.name for u in units],
            "not_removable": fixed,  # blocks that change the shape of their input and have no known shortcut
            "intact_accuracy": intact,
            "single": single,
            "random": random,
            "random_pool": [u.name for u in pool],
            "protocol": {
                "follows": "paper",
                "reference": "Bhojanapalli et al. 2021, Sec. 4 and Fig. 8 (no public "
                "code); Chen et al. 2024 (github.com/Lauch1ng/LKRobust, lession_study) for RepLKNet",
                "differences": [],
            },
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "modes": modes,
                "random_parts": random_parts,
                "random_stages": self.random_stages,
                "samples": self.samples,
                "seed": self.seed,
                "figure": self.figure_layout,
                "lesion": "residual branch removed (block -> its shortcut); part -> branch output zeroed",
            },
        }
        metrics = {"intact_accuracy": intact}
        for mode, rows in single.items():
            if rows:
                metrics[f"{mode}/min_accuracy"] = min(r["accuracy"] for r in rows)
                metrics[f"{mode}/mean_accuracy"] = sum(r["accuracy"] for r in rows) / len(rows)
        for part, by_n in random.items():
            for count, entry in by_n.items():
                metrics[f"random_{part}_{count}/mean_accuracy"] = entry["mean"]
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> Figure:
        """lesion.png as the paper of ``conditions.figure`` draws it. Bhojanapalli et al.'s Fig. 8: (top) "Accuracy
        (%)" against the "Removed block" (1 = first), one line per removed part ("Block", "Self-Attention", "MLP");
        (bottom) against the "Number of removed blocks" n, one curve per part of ``random_parts``, mean with
        standard-error bars and min/max shaded. Chen
        et al.'s Fig. 7: the random lesions against the "Proportion of blocks dropped" (n / all blocks), mean line
        and min/max shaded, the model in the legend. The intact model's accuracy is the dashed line."""
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

        single, random = section["single"], section["random"]
        conditions = section["conditions"]
        label = model_label(conditions.get("arch"))
        chen = conditions.get("figure") == "chen"
        fig, axes = new_figure(1, 2 if random else 1, figsize=(11 if random else 6, 4), squeeze=False)
        ax = axes[0][0]
        names = section["units"]
        for mode, rows in single.items():
            index = {r["unit"]: r["accuracy"] for r in rows}
            xs = [i + 1 for i, name in enumerate(names) if name in index]
            ax.plot(xs, [100 * index[names[x - 1]] for x in xs], marker="o", label=PART_NAMES.get(mode, mode))
        ax.axhline(100 * section["intact_accuracy"], color="gray", linestyle="--", label="Intact")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("Removed block")
        ax.set_ylabel("Accuracy (%)")
        ax.set_title(f"One block removed: {label}", fontsize=10)
        ax.legend(fontsize=8)
        if random:
            ax = axes[0][1]
            several = len(random) > 1
            for part, by_n in random.items():
                ns = sorted(by_n, key=int)
                at: list[float] = [int(n) / len(names) if chen else int(n) for n in ns]
                means = [100 * by_n[n]["mean"] for n in ns]
                name = f"{label}, {PART_NAMES.get(part, part)}" if several or part != "block" else label
                if chen:
                    line = ax.plot(at, means, marker="o", label=name)[0]
                else:
                    line = ax.errorbar(
                        at,
                        means,
                        yerr=[100 * by_n[n]["stderr"] for n in ns],
                        marker="o",
                        capsize=3,
                        label=f"{name}: mean ± standard error",
                    ).lines[0]
                ax.fill_between(
                    at,
                    [100 * by_n[n]["min"] for n in ns],
                    [100 * by_n[n]["max"] for n in ns],
                    alpha=0.2,
                    color=line.get_color(),
                    label=None if several else "min / max",
                )
            ax.axhline(100 * section["intact_accuracy"], color="gray", linestyle="--", label="Intact")
            if not chen:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("Proportion of blocks dropped" if chen else "Number of removed blocks")
            ax.set_ylabel("Accuracy (%)")
            ax.set_title(f"Random lesions ({conditions['samples']} samples per n; shaded: min / max)", fontsize=10)
            ax.legend(fontsize=8)
        fig.tight_layout()
        return fig
