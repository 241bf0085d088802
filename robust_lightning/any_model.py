"""``robust_lightning.evaluate``: the project's evaluations on any model, from a notebook.

    result = robust_lightning.evaluate(model, (x, y), threat_models=[{"norm": "Linf", "eps": 4 / 255}])
    result["autoattack"]["threat_models"]["Linf-4_255"]["robust_accuracy"]

The model is any ``nn.Module`` mapping [0, 1] images to logits (``mean``/``std`` put a normaliser in front of a
model that expects normalised input). The evaluations are the callbacks ``robust-lightning test`` runs
(AutoAttack, the distribution shifts, ImageNet-C and -P, the resolution sweep, the card), run by a Lightning
Trainer on the given data: nothing here evaluates anything itself.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from robust_lightning.atomic import atomic_write_json
from robust_lightning.data.batch import IMAGE, KEY, LABEL
from robust_lightning.data.contract import EvaluationSource, TrainingSample
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.samplers import ExactDistributedSampler
from robust_lightning.data.sources import FolderSource
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import DEFAULT_THREAT_MODELS, AutoAttackEvaluation
from robust_lightning.evaluation.base import Evaluation, evaluating
from robust_lightning.evaluation.benchmarks import SHIFT_BENCHMARKS, DistributionShiftBenchmarks
from robust_lightning.evaluation.card import RobustnessCard
from robust_lightning.evaluation.imagenet_c import ImageNetC
from robust_lightning.evaluation.imagenet_p import ImageNetP
from robust_lightning.evaluation.resolution import ResolutionSweep
from robust_lightning.evaluation.results import RunResults
from robust_lightning.job_signals import JobSignals, JobStopped


def evaluation_names() -> list[str]:
    """The evaluations ``evaluate`` runs by name: AutoAttack, each distribution-shift benchmark registered in
    ``SHIFT_BENCHMARKS``, ImageNet-C and -P, the resolution sweep and the card."""
    return ["autoattack", *SHIFT_BENCHMARKS, "imagenet_c", "imagenet_p", "resolution_sweep", "card"]


OWN_PREPROCESSING = "generated ImageNet-C and the resolution sweep"


_Item = dict[str, Tensor | str]  # an image, its label and its key


class _Items(Dataset[_Item]):
    def __init__(self, images: Tensor, labels: Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> _Item:
        return {IMAGE: self.images[i], LABEL: self.labels[i], KEY: f"{i:08d}"}  # keys: AutoAttack's outcomes


class GivenImages(LightningDataModule):
    """Evaluation images given in memory (``EvaluationData`` for ``robust_lightning.evaluate``): N x C x H x W
    float in [0, 1] or uint8, labels N integers; the images are evaluated as they are (no resize, no crop)."""

    def __init__(self, images: Tensor, labels: Tensor, batch_size: int):
        super().__init__()
        self.images, self.labels, self.batch_size = images, labels, batch_size
        self.image_size, self.crop_pct, self.num_workers = images.shape[-1], 1.0, 0
        self.eval_resize = "none (the images as given)"

    def test_dataloader(self) -> DataLoader[_Item]:
        return self.eval_dataloader_with(None)

    def eval_dataloader_with(
        self, transform: object, batch_size: int | None = None, num_workers: int | None = None
    ) -> DataLoader[_Item]:
        if transform is not None:
            raise UserError(
                f"this evaluation reads the images at a preprocessing of its own ({OWN_PREPROCESSING}): "
                "give evaluate an ImageNet val root as data, not tensors"
            )
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        dataset = _Items(self.images, self.labels)
        if len(dataset) < world_size:
            raise UserError(f"{len(dataset)} images cannot be split over {world_size} devices")
        return DataLoader(
            dataset,
            batch_size=batch_size or self.batch_size,
            sampler=ExactDistributedSampler(dataset, world_size, rank),
        )

    def evaluation_source(self) -> EvaluationSource:
        return EvaluationSource(kind="tensors", location=None, imagenet_val=False, own_preprocessing=False)

    def expected_eval_images(self) -> tuple[int | None, frozenset[str] | None]:
        return len(self.labels), None

    def training_sample(
        self,
        device: torch.device | str | None,
        fraction: float = 1.0,
        max_images: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> TrainingSample:
        raise UserError("this evaluation reads training images; evaluate has evaluation images only")

    def conditions(self) -> dict[str, Any]:
        return {
            "source": "tensors",
            "imagenet_val": False,
            "num_images": len(self.labels),
            "image_shape": list(self.images.shape[1:]),
            "preprocessing": "none (the images as given)",
        }


def _tensors(data: tuple[Tensor, Tensor] | DataLoader[object]) -> tuple[Tensor, Tensor]:
    """(images, labels) of an (x, y) pair or of every batch of a loader of (images, labels), checked."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(torch.is_tensor(t) for t in data):
        images, labels = data
    elif isinstance(data, Iterable) and not torch.is_tensor(data) and not isinstance(data, (str, Path, tuple, list)):
        batches = [tuple(batch) for batch in data]
        if not batches or any(len(batch) != 2 or not all(map(torch.is_tensor, batch)) for batch in batches):
            raise UserError("a DataLoader given to evaluate must yield (images, labels) batches of tensors")
        images, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    else:
        raise UserError(
            "data must be an (images, labels) pair of tensors, a DataLoader of (images, labels), or "
            "the path of an ImageNet root holding val/"
        )
    if images.dim() != 4 or labels.dim() != 1 or len(images) != len(labels) or not len(labels):
        raise UserError(
            f"expected images N x C x H x W and N labels, got {tuple(images.shape)} and {tuple(labels.shape)}"
        )
    if images.dtype != torch.uint8:
        if not images.is_floating_point():
            raise UserError(f"images must be float in [0, 1] or uint8, got {images.dtype}")
        low, high = images.min().item(), images.max().item()
        if low < 0 or high > 1:
            raise UserError(
                f"images must be in [0, 1] (the model's normalisation goes in mean/std), got values "
                f"in [{low:.3g}, {high:.3g}]"
            )
    return images, labels.long()


def _num_classes(model: nn.Module, images: Tensor) -> int:
    """The size of the model's logits on two images, checked to be (N, classes)."""
    sample = images[:2]
    sample = sample.float() if sample.is_floating_point() else sample.float() / 255
    parameter = next(model.parameters(), None)
    with torch.no_grad(), evaluating(model):  # eval mode: the check must not move BatchNorm's statistics
        output = model(sample.to(parameter.device) if parameter is not None else sample)
    if not torch.is_tensor(output) or output.dim() != 2 or len(output) != len(sample):
        shape = tuple(output.shape) if torch.is_tensor(output) else type(output).__name__
        raise UserError(
            f"the model must return logits of shape (N, classes); on {len(sample)} images it returned {shape}"
        )
    return output.shape[1]


def _callbacks(
    evaluations: list[str],
    datasets: dict[str, str],
    threat_models: list[dict[str, Any]] | None,
    version: str,
    options: dict[str, dict[str, Any]],
    adaptive_options: dict[str, Any],
) -> list[Evaluation]:
    known = evaluation_names()
    unknown = [name for name in evaluations if name not in known] + [name for name in options if name not in known]
    if unknown:
        raise UserError(f"unknown evaluation {unknown[0]!r}; the evaluations are {', '.join(known)}")
    attack = {
        "threat_models": list(threat_models or DEFAULT_THREAT_MODELS),
        "version": version,
        **adaptive_options,
        **options.get("autoattack", {}),
    }

    def root(name: str) -> str:
        if not datasets.get(name):
            raise UserError(f"evaluation {name!r} needs its dataset root: datasets={{{name!r}: PATH}}")
        return str(datasets[name])

    callbacks: list[Evaluation] = []
    if "card" in evaluations:
        card: dict[str, Any] = {
            key: options[key]
            for key in ("benchmarks", "imagenet_c", "imagenet_p", "resolution_sweep")
            if key in options
        }
        callbacks.append(RobustnessCard(datasets=dict(datasets), autoattack=attack, **card))
    if "autoattack" in evaluations:
        callbacks.append(AutoAttackEvaluation(**attack))
    shifts = [name for name in SHIFT_BENCHMARKS if name in evaluations]
    if shifts:
        needed = {need: datasets.get(need) for name in shifts for need in SHIFT_BENCHMARKS[name].needs}
        roots = {name: root(name) for name in shifts} | needed
        callbacks.append(DistributionShiftBenchmarks(roots=roots, **options.get("benchmarks", {})))
    if "imagenet_c" in evaluations:
        where = root("imagenet_c")
        source: dict[str, Any] = {"source": "generated"} if where == "generated" else {"root": where}
        callbacks.append(ImageNetC(**source, **options.get("imagenet_c", {})))
    if "imagenet_p" in evaluations:
        callbacks.append(ImageNetP(root=root("imagenet_p"), **options.get("imagenet_p", {})))
    if "resolution_sweep" in evaluations:
        callbacks.append(ResolutionSweep(**options.get("resolution_sweep", {})))
    return callbacks


def evaluate(
    model: nn.Module,
    data: tuple[Tensor, Tensor] | DataLoader[object] | str | Path,
    evaluations: list[str] | None = None,
    *,
    threat_models: list[dict[str, Any]] | None = None,
    version: str = "standard",
    mean: tuple[float, float, float] | None = None,
    std: tuple[float, float, float] | None = None,
    datasets: dict[str, str] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    out_dir: str | Path | None = None,
    image_size: int = 224,
    crop_pct: float = 0.875,
    eval_subset: str | None = None,
    eval_limit: int | None = None,
    val_labels: str | None = None,
    batch_size: int = 50,
    num_workers: int | None = None,
    accelerator: str = "auto",
    devices: int | str | list[int] = 1,
    strategy: str = "auto",
    adaptive: str | list[str] = "auto",
    bpda: list[str] | None = None,
    stand_ins: dict[str, nn.Module] | None = None,
    surrogate: nn.Module | str | Path | None = None,
    n_iter: int | None = None,
    n_queries: int | None = None,
) -> dict[str, Any]:
    """Run the project's evaluations on ``model`` and return the sections results.json holds.

    The model runs in eval mode on the accelerator Lightning picks (it is moved there) and comes back in the mode
    it had.

    Args:
        model: any ``nn.Module`` mapping [0, 1] images to logits (N, classes).
        data: an ``(images, labels)`` pair of tensors (float in [0, 1] or uint8, evaluated as they are), a
            DataLoader of ``(images, labels)`` batches (read once, into memory), or an ImageNet root holding
            ``val/`` (read with the project's preprocessing: ``image_size``, ``crop_pct``, ``eval_subset``,
            ``eval_limit``, ``val_labels``, as ``data.*`` of the command line).
        evaluations: names of :func:`evaluation_names`; default ``["autoattack"]``: standard AutoAttack in Linf 4/255,
            L2 2.0 and L1 75, the card's three threat models. Generated ImageNet-C and the resolution sweep need an
            ImageNet root as ``data``.
        threat_models: AutoAttack's, as the AutoAttack callback takes them: ``[{"norm": "Linf", "eps": 4/255}]``.
        version: AutoAttack's version: "standard" (APGD-CE, APGD-T, FAB-T, Square), "rand" (APGD-CE and APGD-DLR
            with 20 EoT passes, for randomized models), "plus" (AA+: more attacks and restarts), or the quick modes
            "apgd-t" (40 iterations, 3 targets) and "apgd-ce" (``n_iter`` steps).
        mean: with ``std``, a normaliser put in front of a model that expects normalised input.
        std: see ``mean``.
        datasets: roots of the benchmarks, under the card's names (``imagenet_r``, ``imagenet_c`` (or
            "generated"), ``imagenet_p``, ``imagenet_val`` for ImageNet-O, ...).
        options: further settings per evaluation, e.g. ``{"autoattack": {"batch_size": 100}}``.
        out_dir: where results.json, the card, the plots and AutoAttack's per-image outcomes go; the same call
            again resumes from them. None: a temporary folder, deleted afterwards.
        batch_size: of the evaluation data.
        num_workers: the evaluation data's loader workers.
        accelerator: Lightning's.
        devices: Lightning's; several devices split the images between them.
        strategy: Lightning's.
        adaptive: AutoAttack's adaptive attacks, run on every image after the standard ones: "auto" (those that
            the raised checks call for: EoT for a randomized model; BPDA, a transfer attack and Square from scratch
            for masked gradients), "none", or a list of names to run always. results.json keeps standard
            AutoAttack's figure, each adaptive attack's and the lowest per image (``reported_robust_accuracy``).
        bpda: the dotted names (``model.named_modules()``) of the parts of ``model`` that mask its gradients: BPDA
            attacks the model with the identity's gradient through them (or ``stand_ins``'), and the transfer
            attack attacks the model without them.
        stand_ins: differentiable modules standing in for the ``bpda`` parts, by name.
        surrogate: a model (or a checkpoint's path) to transfer attacks from, instead of the model without its
            ``bpda`` parts.
        n_iter: APGD's iterations (default: the version's, 100; 40 for "apgd-t"), for a quick look.
        n_queries: Square's queries (default 5000), in the ensemble and from scratch, for a quick look. The budget
            is recorded in results.json (``autoattack.conditions.budget``); standard AutoAttack's figure holds only
            at its own budget.

    SIGTERM (a scheduler's pre-emption or time limit, ``timeout``) stops the evaluation at its next batch, or
    between two attacks of AutoAttack or inside one (``AutoAttack.stop_point``), and raises
    ``robust_lightning.job_signals.JobStopped``, a ``SystemExit`` with the status 143: a script ends as a process
    ended by SIGTERM does, and the same call with the same ``out_dir`` goes on with the outcomes kept (none are kept
    without ``out_dir``). No partial result is returned or written.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch nn.Module, got {type(model).__name__}")
    if model.training:  # said, never a silent switch
        warnings.warn(
            "robust_lightning.evaluate: the model is in train mode (dropout or BatchNorm's batch statistics on); it "
            "is evaluated in eval mode, deterministically. A defence whose randomness lives in train mode is "
            "attacked as given by robust_lightning.attacks.AutoAttack(model).evaluate(x, y), whose check "
            "randomized and EoT then take it into account",
            stacklevel=2,
        )
    evaluations = list(evaluations or ["autoattack"])
    datamodule: ImageNetDataModule | GivenImages
    if isinstance(data, (str, Path)):
        workers: dict[str, Any] = {} if num_workers is None else {"num_workers": num_workers}
        datamodule = ImageNetDataModule(
            source=FolderSource(str(data), val_labels=val_labels),
            image_size=image_size,
            crop_pct=crop_pct,
            eval_subset=eval_subset,
            eval_limit=eval_limit,
            batch_size=batch_size,
            **workers,
        )
        num_classes = datamodule.num_classes
        found = _num_classes(model, torch.zeros(2, 3, image_size, image_size))
        if found != num_classes:
            raise UserError(f"the model has {found} classes, the data's class map {num_classes}")
    else:
        images, labels = _tensors(data)
        num_classes = _num_classes(model, images)
        if labels.min() < 0 or labels.max() >= num_classes:
            raise UserError(
                f"labels must be class indices of the model's {num_classes} classes, got values in "
                f"[{labels.min().item()}, {labels.max().item()}]"
            )
        datamodule = GivenImages(images, labels, batch_size)
    adaptive_options: dict[str, Any] = {
        "adaptive": adaptive,
        "bpda": list(bpda or []),
        "stand_ins": dict(stand_ins or {}),
        "surrogate": str(surrogate) if isinstance(surrogate, (str, Path)) else surrogate,
        **({"n_iter": n_iter} if n_iter is not None else {}),
        **({"n_queries": n_queries} if n_queries is not None else {}),
    }
    callbacks = _callbacks(
        evaluations, dict(datasets or {}), threat_models, version, dict(options or {}), adaptive_options
    )

    from robust_lightning.training.interruption import Interruption  # noqa: PLC0415 (heavy)
    from robust_lightning.training.lightning_module import ImageClassifier  # noqa: PLC0415 (heavy)

    # a module given in Python: ImageClassifier takes one (its arch is typed str, as the command line gives it)
    module = ImageClassifier(
        arch=model,  # type: ignore[arg-type]
        num_classes=num_classes,
        mean=mean,
        std=std,
        image_size=datamodule.image_size,
    )
    with tempfile.TemporaryDirectory(prefix="robust-lightning-evaluate-") as scratch:
        run_dir = Path(out_dir) if out_dir is not None else Path(scratch)
        trainer = Trainer(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            logger=False,
            default_root_dir=str(run_dir),
            enable_checkpointing=False,
            inference_mode=False,
            # the evaluations first: a signal that cuts a batch short is agreed on after the batch's work
            callbacks=[*callbacks, Interruption(), RunResults()],
        )
        try:
            trainer.test(module, datamodule=datamodule)
        except JobStopped as stop:
            then = f"the same call with out_dir={out_dir} goes on" if out_dir is not None else "nothing is kept"
            if stop.requeued:
                stopped, then = "for SLURM's requeue", f"the requeued job runs the script again, and {then}"
            elif stop.requeue:
                stopped = "by SLURM's requeue signal, but the requeue failed"
            else:
                stopped = "by Ctrl-C" if stop.ctrl_c else "by SIGTERM"
            print(f"robust_lightning: evaluate stopped {stopped}; {then}", file=sys.stderr)
            raise
        finally:
            JobSignals.give_back()
        JobSignals.pass_on_unacted()  # signals that came after the test's last batch, to the caller's handlers
        trainer.strategy.barrier()  # under DDP: rank zero has written results.json before any rank reads it
        results = run_dir / "results.json"
        return json.loads(results.read_text()) if results.is_file() else {}


ROBUSTBENCH_IMAGES = 5000  # RobustBench's ImageNet evaluation subset (data/robustbench_imagenet_test_image_ids.txt)
# RobustBench's names of the ImageNet preprocessing (robustbench/data.py) that this project's evaluation runs
ROBUSTBENCH_PREPROCESSING: dict[str, dict[str, Any]] = {
    "BicubicRes256Crop224": {"image_size": 224, "crop_pct": 224 / 256}
}


def benchmark(
    model: nn.Module,
    n_examples: int = 10_000,
    dataset: str = "cifar10",
    threat_model: str = "Linf",
    to_disk: bool = False,
    model_name: str | None = None,
    data_dir: str | Path = "./data",
    corruptions_data_dir: str | None = None,
    device: torch.device | str | None = None,
    batch_size: int = 32,
    eps: float | None = None,
    log_path: str | None = None,
    preprocessing: str | None = None,
    aa_state_path: str | Path | None = None,
) -> tuple[float, float]:
    """RobustBench's ``benchmark`` (robustbench/eval.py), the same arguments in the same order, run as the project's
    standard AutoAttack evaluation (:func:`evaluate`) on RobustBench's ImageNet subset. Returns (clean accuracy,
    robust accuracy) as fractions, and prints them as RobustBench does.

    ``dataset`` must be "imagenet" and ``threat_model`` "Linf" or "L2", with ``eps`` given. ``data_dir`` is an
    ImageNet root holding ``val/<wnid>/<file>``; the first ``n_examples`` (at most 5000) images of RobustBench's
    list are evaluated. ``preprocessing``: None or "BicubicRes256Crop224" (resize 256 bicubic, centre crop 224),
    the one this project runs; RobustBench's default for a model without a zoo entry is its bilinear
    "Res256Crop224", which is refused rather than replaced. ``device``: None is the CPU, as in RobustBench.
    ``aa_state_path``: a folder for the evaluation's outcomes, from which the same call resumes (RobustBench's is a
    file of AutoAttack's state); None evaluates in a temporary folder. ``to_disk`` writes
    ``model_info/imagenet/<threat_model>/<model_name>.json`` as RobustBench's ``update_json`` does (the existing
    file's other fields kept). ``log_path`` and ``corruptions_data_dir`` are not supported."""
    if str(dataset) != "imagenet":
        raise UserError(
            f"robust_lightning.benchmark evaluates RobustBench's ImageNet subset: dataset='imagenet', got {dataset!r}"
        )
    if str(threat_model) not in ("Linf", "L2"):
        raise UserError(
            f"threat_model must be 'Linf' or 'L2', got {threat_model!r} (ImageNet-C: robust_lightning.evaluate(..., "
            "['imagenet_c']))"
        )
    if eps is None:
        raise UserError("If the threat model is L2 or Linf, `eps` must be specified.")  # RobustBench's words
    if not 0 < n_examples <= ROBUSTBENCH_IMAGES:
        raise UserError(
            f"n_examples must be in 1..{ROBUSTBENCH_IMAGES} (RobustBench's ImageNet subset), got {n_examples}"
        )
    if preprocessing not in (None, *ROBUSTBENCH_PREPROCESSING):
        raise UserError(
            f"preprocessing {preprocessing!r} is not available: this project resizes bicubic, as RobustBench's "
            f"'BicubicRes256Crop224' (None means that one here)"
        )
    if log_path is not None or corruptions_data_dir is not None:
        raise UserError("log_path and corruptions_data_dir are not supported by robust_lightning.benchmark")
    if to_disk and model_name is None:
        raise UserError("If `to_disk` is True, `model_name` should be specified.")  # RobustBench's words
    if getattr(model, "training", False):
        warnings.warn("The given model is *not* in eval mode.", stacklevel=2)  # as RobustBench; evaluated in eval mode
    device = torch.device(device or "cpu")
    results = evaluate(
        model,
        data_dir,
        ["autoattack"],
        threat_models=[{"norm": str(threat_model), "eps": float(eps)}],
        version="standard",
        eval_subset="robustbench",
        eval_limit=n_examples if n_examples < ROBUSTBENCH_IMAGES else None,
        batch_size=batch_size,
        out_dir=aa_state_path,
        accelerator="cpu" if device.type == "cpu" else "gpu",
        devices=1 if device.type == "cpu" else [device.index or 0],
        **ROBUSTBENCH_PREPROCESSING["BicubicRes256Crop224"],
    )
    (section,) = results["autoattack"]["threat_models"].values()
    clean, robust = section["clean_accuracy"], section["robust_accuracy"]
    print(f"Clean accuracy: {clean:.2%}")
    print(f"Adversarial accuracy: {robust:.2%}")
    if to_disk:
        path = Path("model_info") / "imagenet" / str(threat_model) / f"{model_name}.json"
        info = json.loads(path.read_text()) if path.is_file() else {}
        info |= {"dataset": "imagenet", "eps": eps, "clean_acc": str(round(clean * 100, 2))}
        info["autoattack_acc"] = str(round(robust * 100, 2))
        atomic_write_json(path, info)
    return clean, robust
