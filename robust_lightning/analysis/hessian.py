"""Hessian max-eigenvalue spectra (Park & Kim, "How Do Vision Transformers Work?", ICLR 2022, Fig. 4).

Per minibatch (16 images in the paper) the top-k (5) eigenvalues of the Hessian of the l2-regularised NLL with
respect to all weights, by power iteration on Hessian-vector products; the spectrum is the histogram of all of
them. NEP (negative eigenvalue proportion) is the share of negative ones, APE (average of positive
eigenvalues) the mean of the positive ones: large positive eigenvalues mean a sharp loss, negative ones a
non-convex one.

The method is the one the authors describe (PyHessian's ``eigenvalues(top_n=k)`` per minibatch, the model in
eval mode): power iteration finds the eigenvalue of largest magnitude; deflation (Gram-Schmidt against the
eigenvectors found so far) then finds the next one, so "top-k" means the k largest in magnitude and includes
large negative eigenvalues. Hessian-vector products are double backward passes through one graph per minibatch.
The l2 term (weight_decay / 2) * ||w||^2 adds weight_decay to every eigenvalue.

BatchNorm uses its running statistics (eval mode, as PyHessian sets it) and dropout / drop-path are off, so the
loss is a deterministic function of the weights.

The loss is the training loss: cross-entropy against the targets training_step uses (MixUp/CutMix's soft
targets, else the labels smoothed by the model's label_smoothing), plus the l2 term of the model's training
weight decay on all weights (the paper: "l2 regularized NLL on augmented training datasets"; it neglects that
the optimiser's decoupled weight decay, which may spare biases and norms, is not exactly an l2 term).

Two ways to run it:

- ``robust-lightning test`` (the paper's protocol, App. A.1, ``data: train``): a fixed random 10% of the
  training set (``train_fraction``), augmented exactly as in training (the data config's transform, crop and
  augmentation scheme), in minibatches of 16; ``max_images`` caps it for quick runs. ``data: eval`` uses the
  clean evaluation images instead, and results.json says those numbers are not comparable with the paper's;
- during ``fit``, every ``every_n_epochs`` epochs: on the first max_images augmented training images of the
  epoch, with the weights at the end of the epoch. results.json section "hessian" then holds the spectrum of
  every such epoch.

A job's signal stops the computation at its next minibatch, or within one every 10 Hessian-vector products. At
test time the command then stops. During a fit the epoch's images stay in the callback's state, and the fit stops
at the start of the next epoch (or at its end), with the weights the spectrum needs, so the checkpoint it writes
holds both. The resumed fit computes that spectrum first, and it keeps the spectra of earlier epochs, so its
results are those of the fit left alone.

At test time the paper's protocol runs for hours on a large model (thousands of minibatches, each up to
top_k x max_iter Hessian-vector products), longer than many jobs may run. So each minibatch's eigenvalues are
appended to ``<results_dir>/minibatches.jsonl`` (fsynced) as soon as they are computed, and the same command run
again, e.g. by a requeued job, computes only the minibatches not saved there. Minibatch i is the same in every run
(the training sample's draws are keyed by batch index, and its power iterations start from seed + i), so the
resumed spectrum is the one of a run left alone, and a run with a larger max_images goes on from a smaller one's.
A folder holding the minibatches of another checkpoint or setting is refused.
"""

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from lightning import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from robust_lightning.analysis.core import (
    AnalysedModule,
    Analysis,
    AnalysisResult,
    Section,
    analysed,
    model_label,
    new_figure,
    stop_point,
)
from robust_lightning.console import tqdm
from robust_lightning.data.batch import soft_targets
from robust_lightning.data.contract import evaluation_data
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import evaluation_source, outcomes_parent, until_stopped
from robust_lightning.evaluation.outcomes import append_record, claim_directory
from robust_lightning.evaluation.results import weights_sha256
from robust_lightning.job_signals import JobStopped, agree_to_stop

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MODEL_MODE = "eval (BatchNorm running statistics, no dropout / drop-path), fp32"
RECORDS = "minibatches.jsonl"  # a JSON line per minibatch: {"minibatch", "eigenvalues", "iterations", "images"}
STOP_CHECK_PRODUCTS = 10  # Hessian-vector products between two asks of the stop point


def read_minibatches(directory: Path) -> dict[int, dict[str, Any]]:
    """The minibatch spectra saved in ``directory``: index -> record, the last one saved where a minibatch was
    computed again. A line cut short by a kill is skipped, and its minibatch is computed again."""
    path = directory / RECORDS
    records: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records[record["minibatch"]] = record
    return records


# ------------------------------------------------------------------------------------------------ the method
def hessian_vector_product(
    loss: Tensor, params: Sequence[Tensor], weight_decay: float = 0.0
) -> Callable[[Tensor], Tensor]:
    """A function v -> (H + weight_decay * I) v for the Hessian H of ``loss`` with respect to ``params``, on
    flat vectors. The gradient graph is built once and reused by every product."""
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    # a gradient that is None or does not depend on the weights has a zero Hessian row (and column)
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    sizes = [p.numel() for p in params]

    def product(v: Tensor) -> Tensor:
        parts = torch.split(v, sizes)
        hv: list[Tensor | None] = [None] * len(params)
        if live:
            out = torch.autograd.grad(
                [grads[i] for i in live],
                params,
                grad_outputs=[parts[i].view_as(params[i]) for i in live],
                retain_graph=True,
                allow_unused=True,
            )
            hv = list(out)
        flat = torch.cat([(h if h is not None else torch.zeros_like(p)).reshape(-1) for h, p in zip(hv, params)])
        return flat + weight_decay * v if weight_decay else flat

    return product


def top_eigenvalues(
    hvp: Callable[[Tensor], Tensor],
    dim: int,
    top_k: int = 5,
    max_iter: int = 100,
    tol: float = 1e-3,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    stop_point: Callable[[], None] = lambda: None,
) -> tuple[list[float], list[int]]:
    """The ``top_k`` eigenvalues of largest magnitude of the symmetric operator ``hvp`` (on vectors of size
    ``dim``), by power iteration with deflation, in the order found. Each one stops when the Rayleigh quotient
    changes by less than ``tol`` (relative) or after ``max_iter`` products. ``stop_point()`` is called every
    ``STOP_CHECK_PRODUCTS`` products and raises to stop (a job's signal). Returns (eigenvalues, iterations)."""
    values: list[float] = []
    iterations: list[int] = []
    vectors: list[Tensor] = []
    products = 0
    for _ in range(top_k):
        v = torch.randn(dim, generator=generator, dtype=dtype).to(device)
        value, steps = None, 0
        for steps in range(1, max_iter + 1):  # noqa: B007 - read after the loop: the iterations it took
            if products and products % STOP_CHECK_PRODUCTS == 0:
                stop_point()
            products += 1
            for u in vectors:  # deflation: stay orthogonal to the eigenvectors found so far
                v = v - torch.dot(u, v) * u
            v = v / v.norm().clamp_min(1e-12)
            hv = hvp(v)
            new = torch.dot(hv, v).item()
            v = hv
            converged = value is not None and abs(new - value) / (abs(value) + 1e-6) < tol
            value = new
            if converged:
                break
        assert value is not None  # max_iter >= 1 products
        for u in vectors:
            v = v - torch.dot(u, v) * u
        vectors.append(v / v.norm().clamp_min(1e-12))
        values.append(value)
        iterations.append(steps)
    return values, iterations


def spectrum_summary(eigenvalues: list[float]) -> dict[str, float]:
    """NEP (share of negative eigenvalues), APE (mean of the positive ones) and the extremes."""
    if not eigenvalues:
        raise ValueError("no eigenvalues")
    values = torch.tensor(eigenvalues, dtype=torch.float64)
    positive = values[values > 0]
    return {
        "nep": float((values < 0).double().mean()),
        "ape": float(positive.mean()) if positive.numel() else 0.0,
        "max_eigenvalue": float(values.max()),
        "min_eigenvalue": float(values.min()),
    }


def minibatch_spectrum(
    model: nn.Module,
    images: Tensor,
    targets: Tensor,
    *,
    top_k: int = 5,
    max_iter: int = 100,
    tol: float = 1e-3,
    weight_decay: float = 0.0,
    seed: int = 0,
    stop_point: Callable[[], None] = lambda: None,
) -> tuple[list[float], list[int]]:
    """Top-k Hessian eigenvalues of the cross-entropy of ``model`` on one minibatch (hard labels or soft
    targets), with respect to all its parameters: in fp32, without autocast and with the math attention kernel.
    The model's mode is left alone; parameters that do not require gradients (EMA weights) are included too.
    ``stop_point``: see :func:`top_eigenvalues`."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    device = images.device
    try:
        for p in params:
            p.requires_grad_(True)
        # the math attention kernel: the fused ones (flash, memory-efficient) have no double backward
        with torch.enable_grad(), torch.autocast(device.type, enabled=False), sdpa_kernel(SDPBackend.MATH):
            loss = F.cross_entropy(model(images.to(params[0].dtype)), targets)
            hvp = hessian_vector_product(loss, params, weight_decay)
            generator = torch.Generator().manual_seed(seed)
            dim = sum(p.numel() for p in params)
            return top_eigenvalues(hvp, dim, top_k, max_iter, tol, generator, device, params[0].dtype, stop_point)
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


# ------------------------------------------------------------------------------------------------ the callback
def training_targets(pl_module: AnalysedModule, batch: dict[str, Tensor]) -> Tensor:
    """The targets of the training loss, formed as ImageClassifier.training_step forms them: MixUp/CutMix's soft
    targets, else the labels smoothed by the model's label_smoothing (the labels themselves without it)."""
    if "target" in batch:
        return batch["target"]
    smoothing = pl_module.hparams.get("label_smoothing") or 0.0
    if not smoothing:
        return batch["label"]
    return soft_targets(batch["label"], pl_module.hparams["num_classes"], smoothing)


class HessianSpectrum(Analysis):
    """Hessian max-eigenvalue spectrum (Park & Kim Fig. 4) at test time, or during fit every N epochs.

    Args:
        data: at test time, "train" (the paper's protocol: a fixed random ``train_fraction`` of the training
            set, augmented as in training, from the data config) or "eval" (the clean evaluation images, not
            comparable with the paper's numbers).
        train_fraction: share of the training set (the paper: 10%), drawn with ``seed``.
        max_images: at most this many images (a cap for quick runs; None: the whole fraction, or with data
            "eval" all evaluation images). During fit: the augmented images recorded per analysed epoch
            (required there).
        batch_size: minibatch size (the paper: 16).
        top_k: eigenvalues per minibatch (the paper: 5).
        max_iter: power-iteration steps per eigenvalue at most (PyHessian's default 100).
        tol: relative change of the eigenvalue estimate that stops its power iteration (PyHessian: 1e-3).
        weight_decay: coefficient of the l2 term (weight_decay / 2) * ||w||^2 of the loss; it adds weight_decay
            to every eigenvalue. None: the model's training weight decay (its hparam weight_decay), as the paper.
        every_n_epochs: during fit, compute the spectrum at the end of every n-th epoch (n, 2n, ...).
        seed: seed of the training subset and of the power iterations' random start vectors.
        results_dir: at test time, the folder of the per-minibatch spectra that a re-run resumes from (default
            ``<trainer.default_root_dir>/hessian``, or ``runs/hessian`` where that is the working directory).
        weights, plot: see Analysis.
    """

    name = "hessian"

    def __init__(
        self,
        data: Literal["train", "eval"] = "train",
        train_fraction: float = 0.1,
        max_images: int | None = None,
        batch_size: int = 16,
        top_k: int = 5,
        max_iter: int = 100,
        tol: float = 1e-3,
        weight_decay: float | None = None,
        every_n_epochs: int = 1,
        seed: int = 0,
        results_dir: str | None = None,
        weights: str = "raw",
        plot: bool = True,
    ):
        if max_images is not None and max_images < 1:
            raise UserError(f"HessianSpectrum.max_images must be a positive count or null, got {max_images}")
        super().__init__(max_images=max_images or 1, batch_size=batch_size, weights=weights, plot=plot)
        # None: the whole subset (the base class only takes a count)
        self.max_images = max_images  # type: ignore[assignment]
        if data not in ("train", "eval"):
            raise UserError(f"HessianSpectrum.data must be 'train' (the paper's protocol) or 'eval', got {data!r}")
        if not 0 < train_fraction <= 1:
            raise UserError(f"HessianSpectrum.train_fraction must be in (0, 1], got {train_fraction}")
        if top_k < 1 or max_iter < 1 or every_n_epochs < 1:
            raise UserError("HessianSpectrum: top_k, max_iter and every_n_epochs must be >= 1")
        if not tol > 0 or (weight_decay is not None and weight_decay < 0):
            raise UserError("HessianSpectrum: tol must be > 0 and weight_decay >= 0 (or null: the model's)")
        self.data, self.train_fraction = data, train_fraction
        self.top_k, self.max_iter, self.tol, self.weight_decay = top_k, max_iter, tol, weight_decay
        self.every_n_epochs, self.seed = every_n_epochs, seed
        self.results_root = Path(results_dir) if results_dir else None  # as configured
        self.locks = ExitStack()  # the records folder's lock, held from the claim until teardown
        self.epochs: dict[int, Section] = {}  # fit: the spectrum of each analysed epoch
        self._recorded: list[tuple[Tensor, Tensor]] = []
        # fit: (epoch, images, targets) of an analysed epoch whose spectrum a stop cut short; saved with the fit
        self._pending: tuple[int, Tensor, Tensor] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.model_weight_decay(analysed(pl_module))  # a missing weight decay is refused before any work
        if stage == "fit" and self.max_images is None:
            raise UserError(
                "HessianSpectrum during fit records max_images augmented images of each analysed epoch: set max_images"
            )
        if stage == "test" and self.data == "train" and evaluation_data(trainer) is None:
            raise UserError(
                "HessianSpectrum.data 'train' needs the training set of an ImageNetDataModule "
                "(robust_lightning.data.datamodule); use data 'eval' for another data module"
            )

    def model_weight_decay(self, pl_module: AnalysedModule) -> float:
        """The coefficient of the l2 term: the one set, else the model's training weight decay."""
        if self.weight_decay is not None:
            return self.weight_decay
        value = pl_module.hparams.get("weight_decay")
        if value is None:
            raise UserError(
                "HessianSpectrum.weight_decay null means the model's training weight decay, but the "
                "model has no hparam weight_decay: set HessianSpectrum.weight_decay"
            )
        return float(value)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.locks.close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.locks.close()

    # ------------------------------------------------------------------------------------------- compute
    def spectrum(
        self,
        model: nn.Module,
        minibatches: Iterable[tuple[Tensor, Tensor]],
        weight_decay: float,
        records: Path | None = None,
    ) -> Section:
        """Top-k eigenvalues of every (images, targets) minibatch, NEP and APE over all of them. ``records``: the
        folder whose saved minibatches are taken as they are and to which each one computed is appended. A saved
        minibatch of another size (the last one of a run with a smaller max_images) is computed again."""
        saved = read_minibatches(records) if records is not None else {}
        if saved:
            rank_zero_info(f"hessian: resuming, {len(saved)} minibatches already computed in {records}")
        was_training = model.training
        model.eval()  # BatchNorm running statistics, no dropout: the loss is a function of the weights only
        eigenvalues, iterations, images = [], [], 0
        try:
            for i, (x, targets) in enumerate(minibatches):
                record = saved.get(i)
                if record is None or record["images"] != len(x):
                    stop_point()
                    values, steps = minibatch_spectrum(
                        model,
                        x,
                        targets,
                        top_k=self.top_k,
                        max_iter=self.max_iter,
                        tol=self.tol,
                        weight_decay=weight_decay,
                        seed=self.seed + i,
                        stop_point=stop_point,
                    )
                    record = {"minibatch": i, "eigenvalues": values, "iterations": steps, "images": len(x)}
                    if records is not None:
                        append_record(records / RECORDS, record)
                eigenvalues.append(record["eigenvalues"])
                iterations.append(record["iterations"])
                images += record["images"]
        finally:
            model.train(was_training)
        if not eigenvalues:
            raise UserError("HessianSpectrum: no images to compute the spectrum on")
        flat = [v for values in eigenvalues for v in values]
        return {
            **spectrum_summary(flat),
            "minibatches": eigenvalues,
            "iterations": iterations,
            "images": images,
            "converged": sum(s < self.max_iter for steps in iterations for s in steps) / len(flat),
        }

    def _conditions(self, model: nn.Module, data: str, weight_decay: float) -> dict[str, Any]:
        return {
            "top_k": self.top_k,
            "minibatch_size": self.batch_size,
            "max_iter": self.max_iter,
            "tol": self.tol,
            "weight_decay": weight_decay,
            "seed": self.seed,
            "data": data,
            "mode": MODEL_MODE,
            "parameters": sum(p.numel() for p in model.parameters()),
        }

    # ------------------------------------------------------------------------------------------ test time
    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        model = self.model(pl_module)
        weight_decay = self.model_weight_decay(pl_module)
        if self.data == "train":
            data = evaluation_data(trainer)
            assert data is not None  # data "train" needs it (setup)
            sample = data.training_sample(
                pl_module.device,
                fraction=self.train_fraction,
                max_images=self.max_images,
                batch_size=self.batch_size,
                seed=self.seed,
            )
            # a job's signal stops it at the next minibatch, as self.batches does: the paper's protocol runs for hours
            minibatches: Iterator[tuple[Tensor, Tensor]] = (
                (b["image"], training_targets(pl_module, b)) for b in until_stopped(sample.batches)
            )
            total = math.ceil(sample.images / self.batch_size)
        else:
            minibatches, total = self.batches(trainer, pl_module), None
        bar = tqdm(
            minibatches, total=total, desc="hessian", unit="minibatch", leave=False, disable=not trainer.is_global_zero
        )
        transform = sample.transform if self.data == "train" else None
        records = self._records_folder(trainer, pl_module, weight_decay, transform)
        result = self.spectrum(model, bar, weight_decay, records)
        if self.data == "train":
            complete = sample.images == sample.subset_images
            comparability = {
                "comparable_with_paper": complete,
                "comparability": "the paper's protocol (App. A.1)"
                if complete
                else f"the paper's protocol on {sample.images} of the {sample.subset_images} images of the "
                f"{self.train_fraction:.0%} subset (max_images): a sample of its minibatches",
                "protocol": {
                    "data": "augmented training images: the training transform, crop and augmentation",
                    "train_fraction": self.train_fraction,
                    "training_images": sample.training_images,
                    "subset_images": sample.subset_images,
                    "max_images": self.max_images,
                    "images": result["images"],
                    "minibatch_size": self.batch_size,
                    "top_k": self.top_k,
                    **sample.transform,
                    "label_smoothing": pl_module.hparams.get("label_smoothing") or 0.0,
                    "weight_decay": weight_decay,
                    "weight_decay_from": "set" if self.weight_decay is not None else "the model's hparams",
                    "model_mode": MODEL_MODE,
                },
            }
            described = f"a {self.train_fraction:.0%} random subset of the training set, augmented as in training"
        else:
            comparability = {
                "comparable_with_paper": False,
                "comparability": "clean evaluation images without augmentation; the paper uses augmented "
                "training images (data: train)",
            }
            described = "evaluation images, no augmentation"
        section = {
            **result,
            **comparability,
            "conditions": {
                **self._conditions(model, described, weight_decay),
                "images": result["images"],
                "results_dir": str(records.resolve()),
            },
        }
        section["conditions"]["arch"] = pl_module.hparams.get("arch")
        figure = self._plot({model_label(section["conditions"]["arch"]): result}) if self.plot else None
        return section, self._metrics(result), figure

    def _records_folder(
        self, trainer: Trainer, pl_module: AnalysedModule, weight_decay: float, transform: dict[str, Any] | None
    ) -> Path:
        """The folder of this test's per-minibatch spectra, claimed for its checkpoint and settings (not the run's
        versioned log folder: a re-run of the same command must find them). ``transform``: the training sample's
        (data "train")."""
        folder = self.results_root or outcomes_parent(trainer) / "hessian"
        source, data = evaluation_source(trainer), evaluation_data(trainer)
        identity: dict[str, Any] = {
            "weights_sha256": weights_sha256(self.network(pl_module)),
            "weights": self.weights,
            "data": self.data,
            "data_source": source.kind if source else None,
            "data_location": source.location if source else None,
            # not max_images: minibatch i is the same whatever the cap, and a larger cap resumes a smaller one's
            "minibatch_size": self.batch_size,
            "top_k": self.top_k,
            "max_iter": self.max_iter,
            "tol": self.tol,
            "weight_decay": weight_decay,
            "seed": self.seed,
        }
        if transform is not None:  # the training sample's subset and augmentation, and the loss's targets
            identity |= {
                "train_fraction": self.train_fraction,
                **transform,
                "label_smoothing": pl_module.hparams.get("label_smoothing") or 0.0,
            }
        else:  # the evaluation images and their preprocessing
            identity |= {
                "image_size": data.image_size if data is not None else None,
                "crop_pct": data.crop_pct if data is not None else None,
                "eval_resize": data.eval_resize if data is not None else None,
                "interpolation": self.interpolation,
                "eval_subset": source.subset if source else None,
                "eval_limit": source.limit if source else None,
            }
        claim_directory(folder, identity, True, "HessianSpectrum", self.locks, read_minibatches)
        return folder

    # ------------------------------------------------------------------------------------------ fit time
    def _due(self, trainer: Trainer) -> bool:
        return (trainer.current_epoch + 1) % self.every_n_epochs == 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name, every_n_epochs=self.every_n_epochs)

    def state_dict(self) -> dict[str, Any]:
        """The spectra of the epochs analysed so far, and the images of one a stop cut short, so that a resumed
        fit publishes every epoch's spectrum."""
        pending = self._pending
        return {
            "epochs": {str(epoch): section for epoch, section in self.epochs.items()},
            "pending": None if pending is None else {"epoch": pending[0], "images": pending[1], "targets": pending[2]},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epochs = {int(epoch): section for epoch, section in state_dict.get("epochs", {}).items()}
        pending = state_dict.get("pending")
        self._pending = None if pending is None else (pending["epoch"], pending["images"], pending["targets"])

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a resumed fit starts where the stop came: the weights are those the cut-short spectrum needs
        if self._pending is not None:
            self._fit_spectrum(trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:  # a fit resumed after its last epoch runs no training hooks
            self._fit_spectrum(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_where_cut_short("epoch start")
        self._recorded = []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_where_cut_short("training end")

    def _stop_where_cut_short(self, where: str) -> None:
        """A stop that cut the last epoch's spectrum short stops the fit here, before another step changes the
        weights (robust_lightning.training.interruption would act after the next step)."""
        if self._pending is not None and (stop := agree_to_stop(where)) is not None:
            raise stop

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # keep the first max_images augmented images of an analysed epoch (on the CPU: GPU memory is training's)
        seen = sum(len(t) for _, t in self._recorded)
        if not self._due(trainer) or seen >= self.max_images or not batch["label"].numel():
            return
        take = self.max_images - seen
        targets = training_targets(analysed(pl_module), batch)
        self._recorded.append((batch["image"][:take].detach().float().cpu(), targets[:take].detach().cpu()))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._due(trainer) or not self._recorded:
            return
        images = torch.cat([x for x, _ in self._recorded])
        targets = torch.cat([t for _, t in self._recorded])
        self._recorded = []
        self._pending = (trainer.current_epoch, images, targets)
        try:
            self._fit_spectrum(trainer, pl_module)
        except JobStopped:
            # a checkpoint written inside the epoch's end would resume past it: the fit stops at the next
            # epoch's start (_stop_where_cut_short), the images kept in the state it saves
            return

    def _fit_spectrum(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The spectrum of the pending epoch's images with the current weights, published with the earlier ones."""
        assert self._pending is not None
        epoch, images, targets = self._pending
        was_training = pl_module.training
        module = analysed(pl_module)
        model = self.model(module)  # eval mode (also the EMA copy's); training resumes in train mode below
        device = pl_module.device
        weight_decay = self.model_weight_decay(module)
        minibatches = (
            (images[i : i + self.batch_size].to(device), targets[i : i + self.batch_size].to(device))
            for i in range(0, len(images), self.batch_size)
        )
        try:
            result = self.spectrum(model, minibatches, weight_decay)
        finally:
            pl_module.train(was_training)
        self._pending = None
        self.epochs[epoch] = result
        section = {
            "epochs": {str(e): r for e, r in sorted(self.epochs.items())},
            "last_epoch": max(self.epochs),
            **{k: result[k] for k in ("nep", "ape", "max_eigenvalue", "min_eigenvalue")},
            "conditions": self._conditions(model, "augmented training images of the epoch (rank 0)", weight_decay),
        }
        figure = self._plot({f"epoch {e}": r for e, r in sorted(self.epochs.items())}) if self.plot else None
        self.publish(trainer, section, self._metrics(result), figure)

    # ------------------------------------------------------------------------------------------- report
    @staticmethod
    def _metrics(result: Section) -> dict[str, float]:
        return {k: result[k] for k in ("nep", "ape", "max_eigenvalue")}

    def _plot(self, spectra: dict[str, Section]) -> "Figure":
        """Park & Kim's Fig. 4: the density of the eigenvalues ("Max Eigenvalue" against "Density"), one line per
        spectrum with the model (test time) or the epoch (fit time) in the legend, as their Fig. 1b overlays
        training phases; with several epochs the last six are overlaid and NEP / APE are drawn against the epoch."""
        over_epochs = len(spectra) > 1
        figure, axes = new_figure(1, 2 if over_epochs else 1, figsize=(11 if over_epochs else 6, 4), squeeze=False)
        ax = axes[0, 0]
        shown = list(spectra.items())[-6:]
        values = [v for _, r in shown for values in r["minibatches"] for v in values]
        low, high = min(values + [0.0]), max(values + [0.0])
        bins = torch.linspace(low, high + 1e-12, 41).tolist()
        for label, r in shown:
            flat = [v for values in r["minibatches"] for v in values]
            ax.hist(flat, bins=bins, density=True, histtype="step", linewidth=1.5, label=label)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("Max Eigenvalue")
        ax.set_ylabel("Density")
        last = shown[-1][1]
        ax.set_title(
            f"top-{self.top_k} per minibatch of {self.batch_size}: NEP {last['nep']:.1%}, APE {last['ape']:.3g}",
            fontsize=9,
        )
        ax.legend(fontsize=8)
        if over_epochs:
            epochs = [int(k.split()[-1]) for k in spectra]
            right = axes[0, 1]
            right.plot(epochs, [r["ape"] for r in spectra.values()], "o-", label="APE (mean positive eigenvalue)")
            right.set_xlabel("epoch")
            right.set_ylabel("APE")
            twin = right.twinx()
            twin.plot(epochs, [r["nep"] for r in spectra.values()], "s--", color="tab:red", label="NEP")
            twin.set_ylabel("NEP (share of negative eigenvalues)")
            right.set_title("APE and NEP during training")
            right.legend(loc="upper left", fontsize=8)
            twin.legend(loc="upper right", fontsize=8)
        figure.tight_layout()
        return figure
