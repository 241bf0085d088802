"""Resolution sweep as a Lightning callback:
``robust-lightning test --config configs/eval/resolution_sweep.yaml --ckpt_path CKPT``.

Clean accuracy and (quick or full) AutoAttack robust accuracy of one model over a list of test resolutions,
with the paper's preprocessing at each resolution r: resize the shorter side to floor(r / crop_pct) (bicubic),
centre-crop r (Singh et al. 2023, Sec. 4; RobustBench's ImageNet preprocessing). Singh et al. find the best test
resolution at 256-288 for every model.

- Input size: ViTs (any timm model with ``set_input_size``) run on a copy of the network set to r x r; the
  model itself is never changed, so the sweep leaves it exactly as it found it. The absolute position
  embeddings are interpolated from the trained grid as Singh et al.'s evaluation code does it
  (``pos_embed_interpolation: singh``, the default: interpolate_pos_encoding in utils_architecture.py of
  nmndeep/revisiting-at, after DINO: plain bicubic with the scale factor (new grid + 0.1) / old grid), so ViT
  numbers at 256-384 px are comparable with the paper's; ``timm`` keeps timm's own resampling
  (``resample_abs_pos_embed``: bicubic to the exact size, antialiased). Convolutional models
  take any size as they are. Before any work each resolution is tried with one forward; a resolution the model
  cannot run at (a fixed-size MLP, a ViT at a size that is not a multiple of its patch) is skipped with a
  warning and listed with its reason under ``skipped_resolutions``, and a model that runs at none of them is a
  UserError.
- Radii: Linf is per pixel and never scaled. With ``scale_l2_with_resolution`` the L2 radius is scaled by
  r / reference (the L2 norm of a fixed per-pixel perturbation grows with the side length), with
  ``scale_l1_with_resolution`` the L1 radius by (r / reference)^2 (the L1 norm grows with the pixel count).
  The paper scales L2 only (eps2 x d / 224), so each is its own switch; the radius used is recorded per cell.
- Resume: every (resolution, clean / threat model) cell has a directory under ``results_dir`` holding per-image
  outcomes (appended and fsynced per batch, in AutoAttackEvaluation's format), a manifest of what they were
  computed with (checkpoint hash, weights, radius, attack settings, data subset) and, once complete,
  ``done.json`` with the images it covers. A re-run skips complete cells (a resolution whose cells are all
  complete is not even read), resumes incomplete ones image by image, and refuses a directory holding outcomes of
  another checkpoint or setting (one holding none is taken over). Outcomes are per image, so a run on more
  images (max_images raised or removed after a quick look) only evaluates the new ones.
- DDP: each rank evaluates its share of the images; outcomes meet in the (shared) results_dir, where every
  image counts once and a cell is only marked complete when its outcomes cover exactly the images all ranks
  read. Accuracies are integer counts over the image count.
- Results: section ``resolution_sweep`` of results.json (per resolution: clean and robust accuracy, radii,
  images, device-seconds; the best resolution by robust accuracy in the first threat model with clean accuracy
  as tie-break, and by clean accuracy; conditions), ``resolution_sweep/...`` logger metrics, and the plot
  ``resolution_sweep.png`` beside results.json (also to W&B when a WandbLogger is present).

Everything runs in ``on_test_end``, after the model's own test set, as the other evaluation callbacks do.
"""

import copy
import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from timm.layers import PatchEmbed
from torch import nn

from robust_lightning.atomic import atomic_write_json
from robust_lightning.attacks.ensemble import (
    ENGINES,
    PRECISIONS,
    VERSIONS,
    AutoAttack,
    EvaluationStopped,
    numerics,
    precision_note,
)
from robust_lightning.data.samplers import rank_share
from robust_lightning.data.transforms import eval_resize_size, eval_transform
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import ThreatModel, parse_threat_models
from robust_lightning.evaluation.base import (
    Evaluation,
    barrier,
    evaluating,
    evaluation_resolution,
    evaluation_source,
    gather_objects,
    new_figure,
    outcomes_parent,
)
from robust_lightning.evaluation.evaluated_module import model_setting, network_runner
from robust_lightning.evaluation.outcomes import append_record, cell_seconds, claim_directory, read_outcomes, summarise
from robust_lightning.evaluation.results import weights_sha256
from robust_lightning.job_signals import stop_requested

__all__ = [
    "DEFAULT_RESOLUTIONS",
    "ResolutionSweep",
    "best_resolutions",
    "check_runs_at",
    "input_size_adaptation",
    "interpolate_pos_embed_singh",
    "network_at",
    "scaled_eps",
]

DEFAULT_RESOLUTIONS = (192, 224, 256, 288, 320, 384)
POS_EMBED_INTERPOLATIONS = ("singh", "timm")
CLEAN = "clean"


# ------------------------------------------------------------------------------------------------- radii
def scaled_eps(threat: ThreatModel, resolution: int, reference: int, scale_l2: bool, scale_l1: bool) -> float:
    """The radius used at ``resolution`` for a threat model quoted at ``reference``: L2 x r / ref and L1 x
    (r / ref)^2 when asked (the norms of a fixed per-pixel perturbation grow so); Linf never."""
    if threat.norm == "L2" and scale_l2:
        return threat.eps * resolution / reference
    if threat.norm == "L1" and scale_l1:
        return threat.eps * (resolution / reference) ** 2
    return threat.eps


# ------------------------------------------------------------------------------------------- input size
def _resizable(network: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost submodule with timm's ``set_input_size`` (a ViT, Swin, ...), or None (a ConvNet)."""
    for name, module in network.named_modules():
        if callable(getattr(module, "set_input_size", None)):
            return name, module
    return None


def input_size_adaptation(network: nn.Module, pos_embed_interpolation: str = "singh") -> str:
    """How the network is set to another resolution, for results.json."""
    found = _resizable(network)
    if found is None:
        return "none (the network takes any input size as it is)"
    if pos_embed_interpolation == "singh" and _grid_pos_embed(found[1]) is not None:
        how = (
            "interpolated as Singh et al.'s evaluation code (DINO-style: bicubic, scale factor (new grid + 0.1) / "
            "old grid, no antialiasing)"
        )
    else:
        how = "resampled by timm (bicubic to the exact grid, antialiased)"
    return f"{type(found[1]).__name__}.set_input_size on a copy; absolute position embeddings {how}"


def _grid_pos_embed(module: nn.Module) -> tuple[int, tuple[int, int]] | None:
    """(prefix tokens in pos_embed, grid) of a timm ViT with a learned absolute position embedding, else None."""
    pos_embed, patch_embed = getattr(module, "pos_embed", None), getattr(module, "patch_embed", None)
    grid = getattr(patch_embed, "grid_size", None)
    if not isinstance(pos_embed, torch.Tensor) or grid is None:
        return None
    prefix = 0 if getattr(module, "no_embed_class", False) else getattr(module, "num_prefix_tokens", 0)
    return prefix, tuple(grid)


def interpolate_pos_embed_singh(
    pos_embed: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int], num_prefix_tokens: int
) -> torch.Tensor:
    """Position embeddings for ``new_grid`` as Singh et al.'s evaluation code computes them (interpolate_pos_encoding
    in utils_architecture.py of nmndeep/revisiting-at, adapted from DINO): the prefix (class token) embedding
    kept, the patch grid resized bicubically with the scale factor (new + 0.1) / old (the 0.1 guards the output
    size against floating-point error), no antialiasing."""
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    grid = grid.reshape(1, *old_grid, dim).permute(0, 3, 1, 2)
    scale = tuple((new + 0.1) / old for new, old in zip(new_grid, old_grid))
    grid = F.interpolate(grid, scale_factor=scale, mode="bicubic", align_corners=False)
    if tuple(grid.shape[-2:]) != tuple(new_grid):
        raise ValueError(f"position-embedding grid {tuple(grid.shape[-2:])} after interpolation, expected {new_grid}")
    return torch.cat([prefix, grid.permute(0, 2, 3, 1).reshape(1, -1, dim)], dim=1)


def network_at(network: nn.Module, resolution: int, pos_embed_interpolation: str = "singh") -> nn.Module:
    """``network`` set up for ``resolution`` x ``resolution`` inputs: itself when nothing in it depends on the
    input size (ConvNets) or it is at that size already, else a copy whose input size (and with it the ViT
    position-embedding grid, see ``pos_embed_interpolation`` in the module docstring) is changed. ``network``
    itself is never modified."""
    found = _resizable(network)
    if found is None:
        return network
    name, module = found
    patch_embed = module if isinstance(module, PatchEmbed) else getattr(module, "patch_embed", None)
    patch = getattr(patch_embed, "patch_size", None)
    if (
        patch
        and not getattr(patch_embed, "dynamic_img_pad", False)
        and (resolution % patch[0] or resolution % patch[1])
    ):
        raise UserError(
            f"resolution {resolution} is not a multiple of the model's patch size {tuple(patch)}: "
            f"the {type(module).__name__} cannot split it into patches; use multiples of {patch[0]}"
        )
    if tuple(getattr(patch_embed, "img_size", None) or ()) == (resolution, resolution):
        return network
    resized = copy.deepcopy(network)
    try:
        target: Any = resized.get_submodule(name)  # a timm ViT: set_input_size, pos_embed, patch_embed
        target.set_input_size(img_size=(resolution, resolution))
        trained = _grid_pos_embed(module)
        if pos_embed_interpolation == "singh" and trained is not None:
            prefix, old_grid = trained
            with torch.no_grad():  # replaces timm's resampling from the same trained embedding
                target.pos_embed.data = interpolate_pos_embed_singh(
                    cast(torch.Tensor, module.pos_embed), old_grid, tuple(target.patch_embed.grid_size), prefix
                )
    except (ValueError, RuntimeError, AssertionError, NotImplementedError, TypeError) as e:
        raise UserError(
            f"the {type(module).__name__} cannot be set to {resolution} x {resolution} inputs "
            f"({type(e).__name__}: {e}); leave this resolution out of ResolutionSweep.resolutions"
        ) from e
    return resized


def check_runs_at(
    model: Callable[[torch.Tensor], torch.Tensor], resolution: int, device: torch.device, arch: str
) -> None:
    """One forward of a blank image: a model that cannot run at this size fails here, before any work."""
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, resolution, resolution, device=device))
    except (RuntimeError, AssertionError, ValueError) as e:
        raise UserError(
            f"the model ({arch}) cannot run at {resolution} x {resolution} px ({type(e).__name__}: "
            f"{e}); leave this resolution out of ResolutionSweep.resolutions"
        ) from e


# -------------------------------------------------------------------------------------------- choosing
def best_resolutions(rows: dict[int, dict[str, Any]], threat_model: str | None) -> dict[str, Any]:
    """The best resolution by robust accuracy in ``threat_model`` (clean accuracy breaks ties) and by clean
    accuracy; remaining ties go to the smaller (cheaper) resolution. ``rows``: resolution ->
    {"clean_accuracy": float, "robust_accuracy": {threat model: float}}; rows without images are left out."""
    rows = {r: row for r, row in rows.items() if row.get("clean_accuracy") is not None}
    if not rows:
        return {"by_robust": None, "by_clean": None}
    by_clean = max(sorted(rows), key=lambda r: rows[r]["clean_accuracy"])  # max keeps the first of equals
    best = {"by_robust": None, "by_clean": {"resolution": by_clean, "clean_accuracy": rows[by_clean]["clean_accuracy"]}}
    robust = {r: row for r, row in rows.items() if row.get("robust_accuracy", {}).get(threat_model) is not None}
    if threat_model is not None and robust:
        r = max(sorted(robust), key=lambda r: (robust[r]["robust_accuracy"][threat_model], robust[r]["clean_accuracy"]))
        best["by_robust"] = {
            "threat_model": threat_model,
            "resolution": r,
            "robust_accuracy": robust[r]["robust_accuracy"][threat_model],
            "clean_accuracy": robust[r]["clean_accuracy"],
        }
    return best


# --------------------------------------------------------------------------------------------- outcomes
@dataclass(frozen=True)
class Cell:
    """One (resolution, clean or threat model) entry of the sweep and where its outcomes live."""

    resolution: int
    name: str  # "clean" or the threat model's name (at its nominal radius)
    threat: ThreatModel | None  # with the radius actually used at this resolution
    directory: Path
    max_images: int | None  # the image selection a complete cell must cover

    def done(self) -> dict[str, Any] | None:
        """done.json when the cell is complete for this image selection (its "keys": the images), else None."""
        path = self.directory / "done.json"
        done = json.loads(path.read_text()) if path.is_file() else None
        return done if done is not None and done.get("max_images") == self.max_images else None

    @property
    def complete(self) -> bool:
        return self.done() is not None

    def outcomes(self) -> dict[str, dict[str, Any]]:
        """The saved outcomes of the images this cell covers (all saved ones while it is incomplete)."""
        outcomes, done = read_outcomes(self.directory), self.done()
        return outcomes if done is None else {key: outcomes[key] for key in done["keys"]}


class ResolutionSweep(Evaluation):
    """Clean and robust accuracy over test resolutions, after ``test`` (see the module docstring).

    Args:
        resolutions: test resolutions r (square crops); default 192, 224, 256, 288, 320, 384.
        crop_pct: the eval transform resizes the shorter side to floor(r / crop_pct) before the centre crop.
        threat_models: list of {norm, eps} at the reference resolution; default Linf 4/255.
        attack: "apgd-t" (quick: 40 iterations, 3 targets, the paper's sweeps), "standard" (full AutoAttack),
            "apgd-ce" (``n_iter`` steps) or None (clean accuracy only).
        n_iter: iterations of the quick modes (default 40 for apgd-t, 100 for apgd-ce).
        engine, precision, seed: as for AutoAttackEvaluation (successes are verified in fp32 either way).
        scale_l2_with_resolution: L2 radius x r / reference_resolution (as the paper allows).
        scale_l1_with_resolution: L1 radius x (r / reference_resolution)^2.
        reference_resolution: the resolution the radii are quoted at and the training resolution the plot marks
            (default: the model's image_size, else the data's, else 224).
        batch_size: images per loader batch and points attacked at once (default: data.eval_batch_size).
        max_images: evaluate only the first n evaluation images (split over the ranks; with folder data
            exactly the first n, with shards n images of the ranks' streams); None: all of them.
        weights: "raw" or "ema" (the EMA weights of a model trained with model.ema_decay).
        pos_embed_interpolation: ViTs at another resolution: "singh" (Singh et al.'s evaluation code, DINO-style
            bicubic; the default) or "timm" (timm's resample_abs_pos_embed).
        plot: draw resolution_sweep.png beside results.json.
        results_dir: where per-image outcomes go (default ``<trainer.default_root_dir>/resolution_sweep``, or
            ``runs/resolution_sweep`` where that is the working directory); a
            re-run with the same directory resumes. It must be on a filesystem all ranks share.
    """

    name = "resolution_sweep"

    def __init__(
        self,
        resolutions: list[int] = list(DEFAULT_RESOLUTIONS),  # noqa: B006 - a default --print_config shows; read, never mutated
        crop_pct: float = 0.875,
        threat_models: list[dict[str, Any]] = [{"norm": "Linf", "eps": 4 / 255}],  # noqa: B006 - a default --print_config shows; read, never mutated
        attack: str | None = "apgd-t",
        n_iter: int | None = None,
        engine: str = "fast",
        precision: str = "fp32",
        seed: int = 0,
        scale_l2_with_resolution: bool = False,
        scale_l1_with_resolution: bool = False,
        reference_resolution: int | None = None,
        batch_size: int | None = None,
        max_images: int | None = None,
        weights: str = "raw",
        pos_embed_interpolation: str = "singh",
        plot: bool = True,
        results_dir: str | None = None,
    ):
        for name, value, allowed in (
            ("attack", attack, (*VERSIONS, None)),
            ("engine", engine, ENGINES),
            ("precision", precision, PRECISIONS),
            ("weights", weights, ("raw", "ema")),
            ("pos_embed_interpolation", pos_embed_interpolation, POS_EMBED_INTERPOLATIONS),
        ):
            if value not in allowed:
                raise UserError(f"ResolutionSweep.{name} must be one of {allowed}, got {value!r}")
        resolutions = [int(r) for r in resolutions]
        if not resolutions or min(resolutions) < 1 or len(set(resolutions)) != len(resolutions):
            raise UserError(f"ResolutionSweep.resolutions must be distinct positive sizes, got {resolutions}")
        if not 0 < crop_pct <= 1:
            raise UserError(f"ResolutionSweep.crop_pct must be in (0, 1], got {crop_pct}")
        for name, number in (
            ("max_images", max_images),
            ("batch_size", batch_size),
            ("n_iter", n_iter),
            ("reference_resolution", reference_resolution),
        ):
            if number is not None and number < 1:
                raise UserError(f"ResolutionSweep.{name} must be a positive number, got {number}")
        # without an attack: clean accuracy only
        self.threat_models = [] if attack is None else parse_threat_models(threat_models, "ResolutionSweep", n_iter)
        self.resolutions, self.crop_pct = sorted(resolutions), float(crop_pct)
        self.attack, self.n_iter, self.engine, self.precision, self.seed = attack, n_iter, engine, precision, seed
        self.scale_l2, self.scale_l1 = scale_l2_with_resolution, scale_l1_with_resolution
        self.reference_resolution, self.batch_size, self.max_images = reference_resolution, batch_size, max_images
        self.weights, self.plot, self.pos_embed_interpolation = weights, plot, pos_embed_interpolation
        self.results_dir = Path(results_dir) if results_dir else None
        self.locks = ExitStack()  # the cells' outcome-folder locks, held from the claim until teardown
        self.skipped: dict[int, str] = {}  # resolution -> why the model cannot run at it

    @property
    def runnable(self) -> list[int]:
        """The resolutions the model runs at (all of them until on_test_start has tried each)."""
        return [r for r in self.resolutions if r not in self.skipped]

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.locks.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.locks.close()

    # ------------------------------------------------------------------------------------------- set-up
    def _model(self, pl_module, network: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return network_runner(pl_module, network)  # the module's own runner applies channels_last

    def cells(self, resolution: int) -> list[Cell]:
        assert self.results_dir is not None  # set when the sweep starts
        directory = self.results_dir / f"{resolution}px"
        cells = [Cell(resolution, CLEAN, None, directory / CLEAN, self.max_images)]
        for threat in self.threat_models:
            eps = scaled_eps(threat, resolution, self.reference, self.scale_l2, self.scale_l1)
            cells.append(
                Cell(resolution, threat.name, ThreatModel(threat.norm, eps), directory / threat.name, self.max_images)
            )
        return cells

    def _identity(self, trainer, cell: Cell) -> dict[str, Any]:
        """What a cell's saved outcomes must have been computed with for a re-run to use them (not max_images:
        outcomes are per image, whichever selection they were part of)."""
        source = evaluation_source(trainer)
        identity = {
            "weights_sha256": self.weights_sha256,
            "weights": self.weights,
            "resolution": cell.resolution,
            "crop_pct": self.crop_pct,
            "cell": cell.name,
            "pos_embed_interpolation": self.pos_embed_interpolation,
            # where the images are read from (manifests from before these keys: in_todays_keys)
            "data_source": source.kind if source else None,
            "data_location": source.location if source else None,
            "eval_subset": source.subset if source else None,
            "eval_limit": source.limit if source else None,
        }
        if cell.threat is not None:
            identity.update(
                norm=cell.threat.norm,
                eps=cell.threat.eps,
                attack=self.attack,
                engine=self.engine,
                precision=self.precision,
                seed=self.seed,
                n_iter=self.n_iter,
            )
        return identity

    def on_test_start(self, trainer, pl_module) -> None:
        """Check everything before any work: settings against saved outcomes, the data, every resolution."""
        network = self.network(pl_module)
        self.check_data(trainer)
        self.skipped = {}
        self.reference = evaluation_resolution(trainer, pl_module, self.reference_resolution)
        # not the versioned log dir: a re-run of the same command must find the saved outcomes
        self.results_dir = self.results_dir or outcomes_parent(trainer) / "resolution_sweep"
        self.weights_sha256 = weights_sha256(network)  # the weights evaluated, however they were loaded
        arch = model_setting(pl_module, "arch", type(network).__name__)
        # eval mode: the trial forwards must not touch BatchNorm statistics
        with evaluating(pl_module), torch.inference_mode(False):
            for r in self.resolutions:
                cells = self.cells(r)
                for cell in cells:
                    claim_directory(
                        cell.directory,
                        self._identity(trainer, cell),
                        trainer.is_global_zero,
                        "ResolutionSweep",
                        self.locks,
                    )
                if all(cell.complete for cell in cells):
                    rank_zero_info(f"resolution sweep {r} px: complete in {cells[0].directory.parent}, skipped")
                    continue
                try:  # the same on every rank: the same model and sizes
                    resized = network_at(network, r, self.pos_embed_interpolation)
                    check_runs_at(self._model(pl_module, resized), r, pl_module.device, arch)
                except UserError as e:
                    self.skipped[r] = str(e).replace("; leave this resolution out of ResolutionSweep.resolutions", "")
                    rank_zero_warn(f"resolution sweep: {r} px skipped: {self.skipped[r]}")
        if not self.runnable:
            raise UserError(
                "ResolutionSweep: the model runs at none of the resolutions "
                f"{self.resolutions}: " + "; ".join(self.skipped.values())
            )

    # ------------------------------------------------------------------------------------------ running
    def on_test_end(self, trainer, pl_module) -> None:
        # the sweep makes its own tensors: gradients work even when the test loop ran under inference mode
        with evaluating(pl_module), torch.inference_mode(False), torch.no_grad():
            for r in self.runnable:
                self._sweep(trainer, pl_module, r)
        self._report(trainer)

    def _share(self, trainer) -> int | None:
        """How many of the first max_images this rank evaluates (None: all of its images)."""
        return None if self.max_images is None else rank_share(self.max_images, trainer.world_size, trainer.global_rank)

    def _sweep(self, trainer, pl_module, resolution: int) -> None:
        """Evaluate this rank's images at one resolution, in every cell not complete yet."""
        cells = self.cells(resolution)
        todo = [cell for cell in cells if not cell.complete]
        if not todo:
            return
        barrier(trainer)  # no rank reads this resolution's saved outcomes while another is already adding to them
        network = network_at(self.network(pl_module), resolution, self.pos_embed_interpolation).eval()
        model = self._model(pl_module, network)
        done = {cell.name: set(read_outcomes(cell.directory)) for cell in todo}
        seen = []
        if trainer.is_global_zero and any(done.values()):
            rank_zero_info(
                f"resolution sweep {resolution} px: resuming, "
                + ", ".join(f"{name} {len(keys)} images done" for name, keys in done.items())
            )
        for batch in self.eval_batches(
            trainer,
            pl_module,
            eval_transform(resolution, self.crop_pct),
            self.max_images,
            self.batch_size,
            progress=f"resolution sweep {resolution} px",
        ):
            images, labels, keys = batch["image"], batch["label"], batch["key"]
            seen += keys
            for cell in todo:
                index = [i for i, key in enumerate(keys) if key not in done[cell.name]]
                if index:
                    try:
                        record = self._evaluate(model, cell, images, labels, keys, index, pl_module.device)
                    except EvaluationStopped:  # a job's stop inside the attack: the next batch boundary ends the sweep
                        break
                    append_record(cell.directory / f"rank{trainer.global_rank}.jsonl", record)
                    done[cell.name].update(record["key"])
        self._complete(trainer, todo, seen)

    def _evaluate(self, model, cell: Cell, images, labels, keys, index, device: torch.device | str) -> dict[str, Any]:
        """Outcomes of one batch in one cell, in AutoAttackEvaluation's record format."""
        picked = torch.tensor(index, device=images.device)
        x, y = images[picked], labels[picked]
        bs = self.batch_size or len(index)
        if cell.threat is None:
            started = time.perf_counter()
            clean = self._clean_flags(model, x, y, bs, device)
            robust, broken_by, seconds = (
                clean,
                [None if ok else "clean" for ok in clean],
                {"clean": time.perf_counter() - started},
            )
        else:
            assert self.attack is not None  # a robust cell exists with an attack only
            adversary = AutoAttack(
                model,
                norm=cell.threat.norm,
                eps=cell.threat.eps,
                version=self.attack,
                seed=self.seed,
                engine=self.engine,
                device=device,
                precision=self.precision,
                n_iter=self.n_iter,
            )
            with torch.enable_grad():
                report = adversary.evaluate(x, y, bs=bs, stop=stop_requested)
            clean, robust = report.clean.tolist(), report.robust.tolist()
            broken_by, seconds = report.broken_by, report.seconds
        return {
            "key": [keys[i] for i in index],
            "label": y.tolist(),
            "clean": clean,
            "robust": robust,
            "broken_by": broken_by,
            "seconds": seconds,
        }

    @staticmethod
    def _clean_flags(model, x, y, bs: int, device: torch.device | str) -> list[bool]:
        """Correct predictions in fp32 with TF32 off, as AutoAttack judges clean points."""
        with torch.no_grad(), numerics("fp32", torch.device(device)):
            return torch.cat(
                [model(x[i : i + bs]).float().argmax(1) == y[i : i + bs] for i in range(0, len(x), bs)]
            ).tolist()

    def _complete(self, trainer, cells: list[Cell], seen: list[str]) -> None:
        """Once every rank has read its images: check the cells hold every one of them, mark them complete."""
        barrier(trainer)  # every rank's outcomes are on disk before anyone reads them
        everyone = [key for keys in gather_objects(seen) for key in keys]
        if not trainer.is_global_zero:
            return
        expected = set(everyone)
        if len(expected) != len(everyone):
            raise UserError(
                f"the evaluation images have duplicate keys ({len(everyone) - len(expected)} repeats): "
                "outcomes are kept per key, so every image needs its own file name"
            )
        for cell in cells:
            missing = expected - set(read_outcomes(cell.directory))
            if missing:  # an outcome file lost or unreadable (results_dir not shared by all ranks?)
                raise UserError(
                    f"{cell.directory} lacks the outcomes of {len(missing)} images (first: "
                    f"{sorted(missing)[0]}); results_dir must be a directory every rank can read"
                )
            atomic_write_json(
                cell.directory / "done.json",
                {"num_images": len(expected), "max_images": self.max_images, "keys": sorted(expected)},
            )

    # ------------------------------------------------------------------------------------------ results
    def _summary(self) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """results.json entries per resolution, and the rows best_resolutions chooses from."""
        resolutions, rows = {}, {}
        for r in self.runnable:
            cells = self.cells(r)
            clean = cells[0].outcomes()
            n = len(clean)
            correct = sum(o["clean"] for o in clean.values())
            entry = {
                "resolution": r,
                "resize": eval_resize_size(r, self.crop_pct),
                "preprocessing": f"resize shorter side to {eval_resize_size(r, self.crop_pct)} (bicubic), "
                f"centre crop {r}",
                "num_images": n,
                "clean_correct": correct,
                "clean_accuracy": correct / n if n else None,
                "threat_models": {},
                "seconds": {CLEAN: cell_seconds(cells[0].directory)},
                "complete": all(cell.complete for cell in cells),
            }
            rows[r] = {"clean_accuracy": entry["clean_accuracy"], "robust_accuracy": {}}
            for cell, nominal in zip(cells[1:], self.threat_models):
                assert self.attack is not None and cell.threat is not None  # the robust cells
                outcomes = cell.outcomes()
                robust = sum(o["robust"] for o in outcomes.values())
                summary = summarise(outcomes, VERSIONS[self.attack])
                entry["threat_models"][cell.name] = {
                    "norm": cell.threat.norm,
                    "eps": cell.threat.eps,
                    "eps_nominal": nominal.eps,
                    "num_points": len(outcomes),
                    "robust_correct": robust,
                    "robust_accuracy": robust / len(outcomes) if outcomes else None,
                    "clean_accuracy_under_attack": summary.get("clean_accuracy"),
                    "robust_accuracy_after": summary.get("robust_accuracy_after", {}),
                }
                entry["seconds"][cell.name] = cell_seconds(cell.directory)
                rows[r]["robust_accuracy"][cell.name] = entry["threat_models"][cell.name]["robust_accuracy"]
            resolutions[str(r)] = entry
        return resolutions, rows

    def _conditions(self, trainer) -> dict[str, Any]:
        assert self.results_dir is not None  # set when the sweep started
        network = self.network(trainer.lightning_module)
        return {
            "attack": self.attack,
            "attacks": list(VERSIONS[self.attack]) if self.attack else [],
            "n_iter": self.n_iter,
            "engine": self.engine,
            "precision": precision_note(self.precision),
            "clean_precision": precision_note("fp32"),
            "seed": self.seed,
            "weights": self.weights,
            "crop_pct": self.crop_pct,
            "reference_resolution": self.reference,
            "threat_models_at_reference": [{"norm": t.norm, "eps": t.eps} for t in self.threat_models],
            "scale_l2_with_resolution": self.scale_l2,
            "scale_l1_with_resolution": self.scale_l1,
            "eps_scaling": "Linf never; L2 x r/reference when scale_l2_with_resolution; L1 x (r/reference)^2 when "
            "scale_l1_with_resolution",
            "input_size": input_size_adaptation(network, self.pos_embed_interpolation),
            "pos_embed_interpolation": self.pos_embed_interpolation,
            "max_images": self.max_images,
            "checkpoint": trainer.ckpt_path,
            "weights_sha256": self.weights_sha256,
            "results_dir": str(self.results_dir.resolve()),
            "seconds": "device-seconds per cell, summed over ranks and sessions",
        }

    def _report(self, trainer) -> None:
        barrier(trainer)
        if not trainer.is_global_zero:
            self.publish(trainer, None, None)  # the run directory is agreed over all ranks
            return
        resolutions, rows = self._summary()
        first = self.threat_models[0].name if self.threat_models else None
        best = best_resolutions(rows, first)
        section: dict[str, Any] = {"resolutions": resolutions, "best": best, "conditions": self._conditions(trainer)}
        section["skipped_resolutions"] = {str(r): reason for r, reason in self.skipped.items()}
        figure = self._plot(rows, best) if self.plot else None
        if figure is None:
            section["plot"] = "not requested"
        names = [t.name for t in self.threat_models]
        table = (
            ["resolution", "images", "clean", *names],
            [
                [
                    r,
                    resolutions[str(r)]["num_images"],
                    row["clean_accuracy"],
                    *(row["robust_accuracy"][n] for n in names),
                ]
                for r, row in rows.items()
            ],
        )

        def message(published: dict[str, Any]) -> list[str]:
            lines = []
            for r, row in rows.items():
                if row["clean_accuracy"] is not None:
                    robust = "".join(
                        f", {n} robust {a:.2%}" for n, a in row["robust_accuracy"].items() if a is not None
                    )
                    lines.append(
                        f"resolution {r}: clean {row['clean_accuracy']:.2%}{robust} on "
                        f"{resolutions[str(r)]['num_images']} images"
                    )
            lines += [f"resolution {r}: skipped, {reason}" for r, reason in self.skipped.items()]
            chosen = best["by_robust"] or best["by_clean"]
            if chosen:
                how = "by " + chosen["threat_model"] + " robust" if "threat_model" in chosen else "by clean"
                lines.append(f"best resolution: {chosen['resolution']} ({how} accuracy); plot: {published['plot']}")
            return lines

        self.publish(trainer, section, flat_metrics(rows, best), figure, {"summary": table}, message)

    def _plot(self, rows: dict[int, dict[str, Any]], best: dict[str, Any]):
        fig, ax = new_figure(figsize=(6, 4))
        shown = [r for r, row in rows.items() if row["clean_accuracy"] is not None]
        colours = {
            "clean": ax.plot(shown, [100 * rows[r]["clean_accuracy"] for r in shown], "o-", label="clean")[
                0
            ].get_color()
        }
        for threat in self.threat_models:
            points = [r for r in shown if rows[r]["robust_accuracy"].get(threat.name) is not None]
            line = ax.plot(
                points,
                [100 * rows[r]["robust_accuracy"][threat.name] for r in points],
                "s-",
                label=f"{threat.name} ({self.attack})",
            )[0]
            colours[threat.name] = line.get_color()
        if best["by_clean"]:
            r = best["by_clean"]["resolution"]
            ax.plot(
                [r],
                [100 * best["by_clean"]["clean_accuracy"]],
                "*",
                markersize=16,
                color=colours["clean"],
                label=f"best clean: {r} px",
            )
        if best["by_robust"]:
            r, name = best["by_robust"]["resolution"], best["by_robust"]["threat_model"]
            ax.plot(
                [r],
                [100 * best["by_robust"]["robust_accuracy"]],
                "*",
                markersize=16,
                color=colours[name],
                label=f"best {name}: {r} px",
            )
        ax.axvline(self.reference, color="grey", linestyle=":", label=f"reference {self.reference} px")
        ax.set_xlabel("test resolution (px)")
        ax.set_ylabel("accuracy (%)")
        ax.set_xticks(shown)
        ax.set_title("Accuracy vs test resolution")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        return fig


def flat_metrics(rows: dict[int, dict[str, Any]], best: dict[str, Any]) -> dict[str, float]:
    """``resolution_sweep/...`` logger keys: accuracies per resolution and the chosen resolutions."""
    metrics = {}
    for r, row in rows.items():
        if row["clean_accuracy"] is not None:
            metrics[f"resolution_sweep/{r}/clean_acc"] = row["clean_accuracy"]
        for name, accuracy in row["robust_accuracy"].items():
            if accuracy is not None:
                metrics[f"resolution_sweep/{r}/{name}/robust_acc"] = accuracy
    if best["by_robust"]:
        metrics["resolution_sweep/best_resolution"] = best["by_robust"]["resolution"]
    if best["by_clean"]:
        metrics["resolution_sweep/best_resolution_clean"] = best["by_clean"]["resolution"]
    return {k: float(v) for k, v in metrics.items()}
