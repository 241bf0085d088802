"""Adversarial sweeps of the seed papers, as evaluation callbacks of ``robust-lightning test``.

- ``AttackSweep``: accuracy under Linf FGSM and PGD over a list of radii (and of PGD step counts).
  Bhojanapalli et al.: FGSM at 1 gray level (eps 1/255) and PGD with 8 steps of 1/8 gray level; Chen et al.:
  PGD with 5 steps of eps/4 and a random start, eps 0.002-0.008, and sweeps over the number of steps.
- ``TransferMatrix``: adversarial examples crafted on model A (rows), accuracy of model B on them (columns),
  for the tested checkpoint and a list of other checkpoints; the diagonal is the white-box attack.
- ``SpatialRobustness``: the spatial grid attack (robust_lightning.attacks.spatial): 9 x 9 translations in
  [-16, 16] px and 31 rotations in [-30, 30] deg, zero fill, worst case per image.

Accuracy is the papers' convention: the share of attacked images classified correctly (a clean error stays an
error after the attack in all but rare FGSM cases). Attacks use the project's ``fgsm`` / ``pgd`` (input
gradients only, [0, 1] box, the model in eval mode); PGD's random start is seeded per batch, so runs repeat.
"""

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning import LightningModule, Trainer
from torch import Tensor, nn

from robust_lightning.analysis.core import (
    AnalysedModule,
    Analysis,
    AnalysisResult,
    Section,
    model_label,
    new_figure,
    stop_point,
)
from robust_lightning.attacks import fgsm, pgd
from robust_lightning.attacks.spatial import spatial_grid_attack
from robust_lightning.console import tqdm
from robust_lightning.errors import UserError
from robust_lightning.models.checkpoints import read_checkpoint
from robust_lightning.models.weights import load_model

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ATTACKS = ("fgsm", "pgd")


def _check_attack(owner: str, attack: str, eps: list[float], steps: list[int], relative_step: float | None) -> None:
    if attack not in ATTACKS:
        raise UserError(f"{owner}: unknown attack {attack!r}; expected one of {ATTACKS}")
    if any(e < 0 for e in eps) or not eps:
        raise UserError(f"{owner}: eps must be a non-empty list of radii >= 0 (Linf, images in [0, 1]), got {eps}")
    if any(s < 1 for s in steps) or not steps:
        raise UserError(f"{owner}: steps must be a non-empty list of PGD iteration counts >= 1, got {steps}")
    if relative_step is not None and not relative_step > 0:
        raise UserError(f"{owner}: relative_step must be > 0 (PGD step = relative_step * eps), got {relative_step}")


def attack_batch(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    attack: str,
    eps: float,
    steps: int = 1,
    relative_step: float | None = None,
    random_start: bool = False,
    seed: int = 0,
) -> Tensor:
    """Linf adversarial examples of one batch; eps 0 returns the images unchanged. A job's signal stops the
    analysis here, before the attack: a sweep or a matrix runs many of them on the same images."""
    stop_point()
    if eps == 0:
        return x
    if attack == "fgsm":
        return fgsm(model, x, y, eps=eps)
    step = None if relative_step is None else relative_step * eps
    return pgd(
        model, x, y, norm="Linf", eps=eps, n_iter=steps, step_size=step, random_start=random_start, generator=seed
    )


@torch.no_grad()
def correct(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits: Tensor = model(x)
    return logits.argmax(1) == y


def _chunks(x: Tensor, y: Tensor, size: int) -> Iterator[tuple[int, Tensor, Tensor]]:
    for i, start in enumerate(range(0, len(y), size)):
        yield i, x[start : start + size], y[start : start + size]


def _step_text(relative_step: float | None, steps: int) -> str:
    return f"{relative_step:g} * eps" if relative_step is not None else f"2.5 * eps / {steps}"


# ------------------------------------------------------------------------------------------------ FGSM / PGD
class AttackSweep(Analysis):
    """Accuracy under FGSM and PGD (Linf) at each radius, and PGD at each step count.

    Args:
        attacks: any of "fgsm", "pgd".
        eps: Linf radii on [0, 1] images (0 = clean); e.g. 0.00392156862745098 = 1/255, one gray level.
        steps: PGD iteration counts; several give a step sweep (FGSM is one step by definition).
        relative_step: PGD step size as a fraction of eps (Bhojanapalli: 1/8 with 8 steps; Chen: 1/4);
            null = the project's default 2.5 * eps / steps.
        random_start: PGD starts uniformly in the ball (Chen et al., after torchattacks' default).
        seed: seed of the random starts (per batch: seed + batch index).
        name: results.json section (several sweeps in one run need different names).
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "attack_sweep"

    def __init__(
        self,
        attacks: Sequence[str] = ("fgsm", "pgd"),
        eps: Sequence[float] = (0.0, 0.00196078431372549, 0.00392156862745098),
        steps: Sequence[int] = (8,),
        relative_step: float | None = 0.125,
        random_start: bool = False,
        seed: int = 0,
        name: str = "attack_sweep",
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        self.attacks, self.eps, self.steps = list(attacks), sorted(float(e) for e in eps), list(steps)
        if not self.attacks:
            raise UserError("AttackSweep.attacks must name at least one of 'fgsm', 'pgd'")
        for attack in self.attacks:
            _check_attack("AttackSweep", attack, self.eps, self.steps, relative_step)
        self.relative_step, self.random_start, self.seed, self.name = relative_step, random_start, seed, name

    def curves(self) -> list[tuple[str, str, int]]:
        """(label, attack, steps) of every curve: one for FGSM, one per step count for PGD."""
        out = []
        for attack in self.attacks:
            out += [("fgsm", "fgsm", 1)] if attack == "fgsm" else [(f"pgd-{s}", "pgd", s) for s in self.steps]
        return out

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        model = self.model(pl_module)
        x, y = self.images(trainer, pl_module)
        clean = torch.cat([correct(model, xb, yb) for _, xb, yb in _chunks(x, y, self.batch_size)])
        curves: dict[str, Any] = {}
        with tqdm(
            total=len(self.curves()) * len(self.eps),
            desc="attack sweep",
            unit="point",
            leave=False,
            disable=not trainer.is_global_zero,
        ) as bar:
            for label, attack, steps in self.curves():
                accuracy = []
                for eps in self.eps:
                    bar.set_postfix_str(f"{label} eps {eps:.4g}")
                    hits = [
                        correct(
                            model,
                            attack_batch(
                                model, xb, yb, attack, eps, steps, self.relative_step, self.random_start, self.seed + i
                            ),
                            yb,
                        )
                        for i, xb, yb in _chunks(x, y, self.batch_size)
                    ]
                    accuracy.append(float(torch.cat(hits).float().mean()))
                    bar.update()
                curves[label] = {
                    "attack": attack,
                    "steps": steps,
                    "eps": self.eps,
                    "accuracy": accuracy,
                    **(
                        {"step_size": _step_text(self.relative_step, steps), "random_start": self.random_start}
                        if attack == "pgd"
                        else {}
                    ),
                }
        section = {
            "clean_accuracy": float(clean.float().mean()),
            "num_images": len(y),
            "curves": curves,
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "norm": "Linf",
                "seed": self.seed,
                "model_mode": "eval",
            },
        }
        metrics = {
            "clean_accuracy": section["clean_accuracy"],
            **{
                f"{label}/eps_{eps:.4g}": acc
                for label, c in curves.items()
                for eps, acc in zip(c["eps"], c["accuracy"])
            },
        }
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> "Figure":
        """Chen et al.'s Fig. 6: (a, b) "Accuracy (%)" against the perturbation budget "ε" (Linf, [0, 1] pixels;
        gray levels on the top axis, Bhojanapalli et al.'s unit), one line per attack with the model in the legend;
        (c) against the "Attack steps" of PGD at each ε, when several step counts were run."""
        label = model_label(section["conditions"].get("arch"))
        curves = section["curves"]
        pgd_curves = [c for c in curves.values() if c["attack"] == "pgd"]
        step_sweep = len(pgd_curves) > 1
        figure, axes = new_figure(1, 2 if step_sweep else 1, figsize=(11 if step_sweep else 6, 4), squeeze=False)
        ax = axes[0, 0]
        for name, c in curves.items():
            ax.plot(c["eps"], [100 * a for a in c["accuracy"]], "o-", label=f"{label}, {name.upper()}")
        ax.set_xlabel("ε")
        ax.set_ylabel("Accuracy (%)")
        ax.secondary_xaxis("top", functions=(lambda e: e * 255, lambda g: g / 255)).set_xlabel("gray levels")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8, title=f"{section['num_images']} images", title_fontsize=8)
        if step_sweep:
            right = axes[0, 1]
            steps = [c["steps"] for c in pgd_curves]
            for j, eps in enumerate(pgd_curves[0]["eps"]):
                if eps > 0:
                    right.plot(
                        steps, [100 * c["accuracy"][j] for c in pgd_curves], "o-", label=f"{label}, ε = {eps:.4g}"
                    )
            right.set_xlabel("Attack steps")
            right.set_ylabel("Accuracy (%)")
            right.set_ylim(0, 100)
            right.legend(fontsize=8)
        figure.tight_layout()
        return figure


# ------------------------------------------------------------------------------------------------ transfer
def checkpoint_label(path: str | Path) -> str:
    """A short name for a checkpoint: its run directory (runs/<run>/[version_N/]checkpoints/x.ckpt -> <run>),
    plus the file stem unless it is "last"."""
    p = Path(path)
    run = next(
        (d.name for d in p.parents if d.name and d.name != "checkpoints" and not d.name.startswith("version_")), p.stem
    )
    return run if p.stem == "last" else f"{run}/{p.stem}"


def load_classifier(path: str, device: torch.device, weights: str = "raw") -> tuple[nn.Module, int]:
    """(classifier in eval mode, num_classes) of a project checkpoint, loaded weights-only through the models
    layer (``load_model``: the architecture, its settings and normaliser from the checkpoint)."""
    if not Path(path).is_file():
        raise UserError(f"TransferMatrix: checkpoint {path} does not exist")
    try:
        checkpoint = read_checkpoint(path)
        if weights == "ema" and not checkpoint.has_ema:
            raise UserError(
                f"TransferMatrix.weights 'ema': {path} has no EMA weights (trained without model.ema_decay)"
            )
        model = load_model(checkpoint=path, prefer_ema=weights == "ema")
    except UserError:
        raise
    except Exception as e:  # a non-Lightning file, a pickled object weights_only refuses, a truncated file
        raise UserError(f"TransferMatrix: cannot load {path} as a robust-lightning checkpoint: {e}") from e
    return model.to(device), int(checkpoint.hyper_parameters.get("num_classes", 1000))


class TransferMatrix(Analysis):
    """Transferability: accuracy of model B (columns) on adversarial examples crafted on model A (rows).

    Args:
        checkpoints: paths of the other models' checkpoints (any architecture; same label space and input size).
        names: labels of the checkpoints in the plot (default: their run directories).
        include_tested_model: make the tested model (ckpt_path) the first row and column.
        attack: "pgd" or "fgsm" (Linf).
        eps: the radius on [0, 1] images.
        steps, relative_step, random_start, seed: PGD settings, as in AttackSweep.
        max_images, batch_size, weights, plot: see Analysis (weights applies to every model).
    """

    name = "transfer_matrix"

    def __init__(
        self,
        checkpoints: Sequence[str] = (),
        names: list[str] | None = None,
        include_tested_model: bool = True,
        attack: str = "pgd",
        eps: float = 0.00392156862745098,
        steps: int = 8,
        relative_step: float | None = 0.125,
        random_start: bool = False,
        seed: int = 0,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        _check_attack("TransferMatrix", attack, [eps], [steps], relative_step)
        if not eps > 0:
            raise UserError("TransferMatrix.eps must be > 0")
        self.checkpoints = list(checkpoints)
        if names is not None and len(names) != len(self.checkpoints):
            raise UserError(f"TransferMatrix.names has {len(names)} entries for {len(self.checkpoints)} checkpoints")
        if len(self.checkpoints) + include_tested_model < 2:
            raise UserError("TransferMatrix needs at least two models: list checkpoints (and/or include_tested_model)")
        self.names = list(names) if names is not None else [checkpoint_label(c) for c in self.checkpoints]
        self.include_tested_model = include_tested_model
        self.attack, self.eps, self.steps, self.relative_step = attack, eps, steps, relative_step
        self.random_start, self.seed = random_start, seed
        self._others: list[nn.Module] = []

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_test_start(trainer, pl_module)
        # load (and check) every checkpoint before the test loop, so a wrong path fails at once
        ours = pl_module.hparams.get("num_classes")
        self._others = []
        for path in self.checkpoints:
            model, classes = load_classifier(path, pl_module.device, self.weights)
            if ours is not None and classes != ours:
                raise UserError(
                    f"TransferMatrix: {path} has {classes} classes, the tested model {ours}; "
                    "transfer needs one label space"
                )
            self._others.append(model)

    def models(self, trainer: Trainer, pl_module: AnalysedModule) -> tuple[list[str], list[nn.Module]]:
        names, models = list(self.names), list(self._others)
        if self.include_tested_model:
            names.insert(0, checkpoint_label(trainer.ckpt_path) if trainer.ckpt_path else "tested model")
            models.insert(0, self.model(pl_module))
        # unique labels: two runs may share a directory name
        seen: dict[str, int] = {}
        for i, n in enumerate(names):
            seen[n] = seen.get(n, 0) + 1
            names[i] = n if seen[n] == 1 else f"{n} ({seen[n]})"
        return names, models

    def matrix(
        self, models: list[nn.Module], x: Tensor, y: Tensor, progress: bool = False
    ) -> tuple[list[float], list[list[float]]]:
        """(clean accuracy per model, accuracy[source][target]); ``progress``: a bar over the attacked batches."""
        n = len(models)
        clean = torch.zeros(n)
        hits = torch.zeros(n, n)
        with tqdm(
            total=math.ceil(len(y) / self.batch_size) * n,
            desc="transfer matrix",
            unit="attack",
            leave=False,
            disable=not progress,
        ) as bar:
            for i, xb, yb in _chunks(x, y, self.batch_size):
                for b, target in enumerate(models):
                    clean[b] += correct(target, xb, yb).sum().item()
                for a, source in enumerate(models):
                    x_adv = attack_batch(
                        source,
                        xb,
                        yb,
                        self.attack,
                        self.eps,
                        self.steps,
                        self.relative_step,
                        self.random_start,
                        self.seed + i,
                    )
                    for b, target in enumerate(models):
                        hits[a, b] += correct(target, x_adv, yb).sum().item()
                    bar.update()
        return (clean / len(y)).tolist(), (hits / len(y)).tolist()

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        names, models = self.models(trainer, pl_module)
        x, y = self.images(trainer, pl_module)
        clean, accuracy = self.matrix(models, x, y, progress=trainer.is_global_zero)
        self._others = []  # free the memory of the other models
        paths = ([trainer.ckpt_path] if self.include_tested_model else []) + self.checkpoints
        section = {
            "models": names,
            "checkpoints": paths,
            "clean_accuracy": dict(zip(names, clean)),
            "accuracy": {src: dict(zip(names, row)) for src, row in zip(names, accuracy)},
            "white_box": {n: accuracy[i][i] for i, n in enumerate(names)},
            "num_images": len(y),
            "conditions": {
                "attack": self.attack,
                "norm": "Linf",
                "eps": self.eps,
                **(
                    {
                        "steps": self.steps,
                        "step_size": _step_text(self.relative_step, self.steps),
                        "random_start": self.random_start,
                    }
                    if self.attack == "pgd"
                    else {}
                ),
                "rows": "source (attacked) model",
                "columns": "evaluated model",
            },
        }
        metrics = {f"{src}->{dst}": accuracy[a][b] for a, src in enumerate(names) for b, dst in enumerate(names)}
        return section, metrics, self._plot(names, clean, accuracy) if self.plot else None

    def _plot(self, names: list[str], clean: list[float], accuracy: list[list[float]]) -> "Figure":
        n = len(names)
        figure, ax = new_figure(figsize=(1.4 * n + 3, 1.1 * n + 2))
        table = [[100 * c for c in clean]] + [[100 * a for a in row] for row in accuracy]
        image = ax.imshow(table, vmin=0, vmax=100, cmap="viridis")
        for r, row in enumerate(table):
            for c, value in enumerate(row):
                ax.text(c, r, f"{value:.1f}", ha="center", va="center", color="white" if value < 60 else "black")
        ax.axhline(0.5, color="white", linewidth=2)
        ax.set_xticks(range(n), names, rotation=30, ha="right")
        ax.set_yticks(range(n + 1), ["clean"] + [f"attack on {m}" for m in names])
        ax.set_xlabel("evaluated model")
        what = (
            f"{self.attack.upper()}{'' if self.attack == 'fgsm' else f'-{self.steps}'} "
            f"Linf eps {self.eps * 255:.3g}/255"
        )
        ax.set_title(f"Transfer accuracy (%), {what}")
        figure.colorbar(image, ax=ax, label="accuracy (%)")
        figure.tight_layout()
        return figure


# ------------------------------------------------------------------------------------------------ spatial
class SpatialRobustness(Analysis):
    """The spatial grid attack: worst case over translations and rotations per image.

    Args:
        translations: shifts per axis (the papers: 9, so 81 translations).
        max_shift: largest shift in pixels of the model's input (16 at 224 px; scale it with the resolution).
        rotations: angles (31).
        max_angle: largest rotation in degrees (30).
        forward_batch: transformed images per forward pass (bounds memory).
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "spatial_attack"

    def __init__(
        self,
        translations: int = 9,
        max_shift: float = 16.0,
        rotations: int = 31,
        max_angle: float = 30.0,
        forward_batch: int = 512,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if translations < 1 or rotations < 1 or forward_batch < 1:
            raise UserError("SpatialRobustness: translations, rotations and forward_batch must be >= 1")
        if max_shift < 0 or max_angle < 0:
            raise UserError("SpatialRobustness: max_shift and max_angle must be >= 0")
        self.translations, self.max_shift, self.rotations, self.max_angle = (
            translations,
            max_shift,
            rotations,
            max_angle,
        )
        self.forward_batch = forward_batch

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        model = self.model(pl_module)
        batches = tqdm(
            self.batches(trainer, pl_module),
            desc="spatial attack",
            unit="batch",
            leave=False,
            total=math.ceil(self.max_images / self.batch_size),
            disable=not trainer.is_global_zero,
        )
        results = [
            spatial_grid_attack(
                model,
                xb,
                yb,
                self.translations,
                self.max_shift,
                self.rotations,
                self.max_angle,
                self.forward_batch,
                stop_point,
            )
            for xb, yb in batches
        ]
        if not results:
            raise UserError("SpatialRobustness: the test set has no images")
        grid = results[0].transforms
        correct_all = torch.cat([r.correct for r in results]).float().cpu()  # (N, T)
        robust = torch.cat([r.robust for r in results]).cpu()
        worst = torch.cat([r.worst_transform.cpu() for r in results])
        shifts = torch.unique(grid[:, 0])
        angles = torch.unique(grid[:, 2])
        no_rotation, no_shift = grid[:, 2] == 0, (grid[:, :2] == 0).all(1)

        def robust_under(keep: Tensor) -> float:
            return float(correct_all[:, keep].min(1).values.mean()) if keep.any() else math.nan

        by_angle = [float(correct_all[:, grid[:, 2] == a].mean()) for a in angles]
        by_shift = [
            [float(correct_all[:, (grid[:, 0] == dx) & (grid[:, 1] == dy)].mean()) for dx in shifts] for dy in shifts
        ]
        section = {
            "clean_accuracy": float(torch.cat([r.clean_correct for r in results]).float().mean()),
            "robust_accuracy": float(robust.float().mean()),
            "translation_only_accuracy": robust_under(no_rotation),
            "rotation_only_accuracy": robust_under(no_shift),
            "num_images": int(robust.numel()),
            "num_transforms": int(grid.shape[0]),
            "shifts": shifts.tolist(),
            "angles": angles.tolist(),
            "accuracy_by_angle": by_angle,
            "accuracy_by_shift": by_shift,
            "images": {"robust": robust.tolist(), "worst_transform": worst.tolist()},
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "translations": self.translations,
                "max_shift_px": self.max_shift,
                "rotations": self.rotations,
                "max_angle_deg": self.max_angle,
                "fill": "zeros",
                "interpolation": "bilinear",
                "order": "rotate about the centre, then shift",
            },
        }
        metrics = {
            k: section[k]
            for k in ("clean_accuracy", "robust_accuracy", "translation_only_accuracy", "rotation_only_accuracy")
        }
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> "Figure":
        figure, (bars, heat, curve) = new_figure(1, 3, figsize=(15, 4.2))
        kinds = ["clean", "translations", "rotations", "full grid"]
        values = [
            section[k]
            for k in ("clean_accuracy", "translation_only_accuracy", "rotation_only_accuracy", "robust_accuracy")
        ]
        bars.bar(kinds, [100 * v for v in values], color=["C0", "C1", "C2", "C3"])
        for i, v in enumerate(values):
            bars.text(i, 100 * v + 1, f"{100 * v:.1f}", ha="center")
        bars.set_ylim(0, 105)
        bars.set_ylabel("Accuracy (%)")  # Bhojanapalli et al.'s Fig. 3 (right): worst case per image
        bars.set_title(
            f"{model_label(section['conditions'].get('arch'))}: {section['num_transforms']} transforms, "
            f"{section['num_images']} images",
            fontsize=10,
        )
        shifts = section["shifts"]
        half = (shifts[1] - shifts[0]) / 2 if len(shifts) > 1 else 0.5  # cells centred on their shift
        image = heat.imshow(
            [[100 * v for v in row] for row in section["accuracy_by_shift"]],
            vmin=0,
            vmax=100,
            origin="upper",
            extent=[shifts[0] - half, shifts[-1] + half, shifts[-1] + half, shifts[0] - half],
        )
        heat.set_xlabel("x shift (px)")
        heat.set_ylabel("y shift (px)")
        heat.set_title("Accuracy per shift (mean over angles)")
        figure.colorbar(image, ax=heat, label="accuracy (%)")
        curve.plot(section["angles"], [100 * v for v in section["accuracy_by_angle"]], "o-")
        curve.set_xlabel("rotation (deg)")
        curve.set_ylabel("accuracy (%)")
        curve.set_ylim(0, 100)
        curve.set_title("Accuracy per angle (mean over shifts)")
        figure.tight_layout()
        return figure
