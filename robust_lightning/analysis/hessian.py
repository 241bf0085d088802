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

Two ways to run it:

- ``robust-lightning test``: on the first max_images evaluation images (no augmentation);
- during ``fit``, every ``every_n_epochs`` epochs: on the first max_images augmented training images of the
  epoch (the paper's data: augmentation and, with MixUp/CutMix, the mixed soft targets), with the weights at
  the end of the epoch. results.json section "hessian" then holds the spectrum of every such epoch.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from robust_lightning.analysis.base import Analysis, new_figure
from robust_lightning.errors import UserError


# ------------------------------------------------------------------------------------------------ the method
def hessian_vector_product(loss: Tensor, params: list[Tensor], weight_decay: float = 0.0) -> Callable[[Tensor], Tensor]:
    """A function v -> (H + weight_decay * I) v for the Hessian H of ``loss`` with respect to ``params``, on
    flat vectors. The gradient graph is built once and reused by every product."""
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    # a gradient that is None or does not depend on the weights has a zero Hessian row (and column)
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    sizes = [p.numel() for p in params]

    def product(v: Tensor) -> Tensor:
        parts = v.split(sizes)
        hv = [None] * len(params)
        if live:
            out = torch.autograd.grad([grads[i] for i in live], params,
                                      grad_outputs=[parts[i].view_as(params[i]) for i in live],
                                      retain_graph=True, allow_unused=True)
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
) -> tuple[list[float], list[int]]:
    """The ``top_k`` eigenvalues of largest magnitude of the symmetric operator ``hvp`` (on vectors of size
    ``dim``), by power iteration with deflation, in the order found. Each one stops when the Rayleigh quotient
    changes by less than ``tol`` (relative) or after ``max_iter`` products. Returns (eigenvalues, iterations)."""
    values, iterations, vectors = [], [], []
    for _ in range(top_k):
        v = torch.randn(dim, generator=generator, dtype=dtype).to(device)
        value, steps = None, 0
        for steps in range(1, max_iter + 1):
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


def minibatch_spectrum(model: nn.Module, images: Tensor, targets: Tensor, *, top_k: int = 5, max_iter: int = 100,
                       tol: float = 1e-3, weight_decay: float = 0.0, seed: int = 0) -> tuple[list[float], list[int]]:
    """Top-k Hessian eigenvalues of the cross-entropy of ``model`` on one minibatch (hard labels or soft
    targets), with respect to all its parameters: in fp32, without autocast and with the math attention kernel.
    The model's mode is left alone; parameters that do not require gradients (EMA weights) are included too."""
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
            return top_eigenvalues(hvp, sum(p.numel() for p in params), top_k, max_iter, tol, generator, device,
                                   params[0].dtype)
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


# ------------------------------------------------------------------------------------------------ the callback
class HessianSpectrum(Analysis):
    """Hessian max-eigenvalue spectrum (Park & Kim Fig. 4) at test time, or during fit every N epochs.

    Args:
        top_k: eigenvalues per minibatch (the paper: 5).
        max_iter: power-iteration steps per eigenvalue at most (PyHessian's default 100).
        tol: relative change of the eigenvalue estimate that stops its power iteration (PyHessian: 1e-3).
        weight_decay: coefficient of the l2 term (weight_decay / 2) * ||w||^2 of the loss; it adds weight_decay
            to every eigenvalue. The paper uses the training weight decay of each model.
        every_n_epochs: during fit, compute the spectrum at the end of every n-th epoch (n, 2n, ...).
        seed: seed of the power iterations' random start vectors.
        max_images: images in all (max_images / batch_size minibatches).
        batch_size: minibatch size (the paper: 16).
        weights, plot: see Analysis.
    """

    name = "hessian"

    def __init__(self, top_k: int = 5, max_iter: int = 100, tol: float = 1e-3, weight_decay: float = 0.0,
                 every_n_epochs: int = 1, seed: int = 0, max_images: int = 64, batch_size: int = 16,
                 weights: str = "raw", plot: bool = True):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if top_k < 1 or max_iter < 1 or every_n_epochs < 1:
            raise UserError("HessianSpectrum: top_k, max_iter and every_n_epochs must be >= 1")
        if not tol > 0 or weight_decay < 0:
            raise UserError("HessianSpectrum: tol must be > 0 and weight_decay >= 0")
        self.top_k, self.max_iter, self.tol, self.weight_decay = top_k, max_iter, tol, weight_decay
        self.every_n_epochs, self.seed = every_n_epochs, seed
        self.epochs: dict[int, dict[str, Any]] = {}  # fit: the spectrum of each analysed epoch
        self._recorded: list[tuple[Tensor, Tensor]] = []

    # ------------------------------------------------------------------------------------------- compute
    def spectrum(self, model: nn.Module, minibatches) -> dict[str, Any]:
        """Top-k eigenvalues of every (images, targets) minibatch, NEP and APE over all of them."""
        was_training = model.training
        model.eval()  # BatchNorm running statistics, no dropout: the loss is a function of the weights only
        eigenvalues, iterations = [], []
        try:
            for i, (images, targets) in enumerate(minibatches):
                values, steps = minibatch_spectrum(model, images, targets, top_k=self.top_k, max_iter=self.max_iter,
                                                   tol=self.tol, weight_decay=self.weight_decay, seed=self.seed + i)
                eigenvalues.append(values)
                iterations.append(steps)
        finally:
            model.train(was_training)
        if not eigenvalues:
            raise UserError("HessianSpectrum: no images to compute the spectrum on")
        flat = [v for values in eigenvalues for v in values]
        return {**spectrum_summary(flat), "minibatches": eigenvalues, "iterations": iterations,
                "converged": sum(s < self.max_iter for steps in iterations for s in steps) / len(flat)}

    def _conditions(self, model: nn.Module, data: str) -> dict[str, Any]:
        return {"top_k": self.top_k, "minibatch_size": self.batch_size, "max_iter": self.max_iter, "tol": self.tol,
                "weight_decay": self.weight_decay, "seed": self.seed, "data": data,
                "mode": "eval (BatchNorm running statistics, no dropout / drop-path), fp32",
                "parameters": sum(p.numel() for p in model.parameters())}

    # ------------------------------------------------------------------------------------------ test time
    def analyse(self, trainer, pl_module):
        model = self.model(pl_module)
        result = self.spectrum(model, self.batches(trainer, pl_module))
        section = {**result, "conditions": self._conditions(model, "evaluation images, no augmentation")}
        figure = self._plot({"evaluation images": result}) if self.plot else None
        return section, self._metrics(result), figure

    # ------------------------------------------------------------------------------------------ fit time
    def _due(self, trainer) -> bool:
        return (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._recorded = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # keep the first max_images augmented images of an analysed epoch (on the CPU: GPU memory is training's)
        seen = sum(len(t) for _, t in self._recorded)
        if not self._due(trainer) or seen >= self.max_images or not batch["label"].numel():
            return
        take = self.max_images - seen
        targets = batch.get("target", batch["label"])  # MixUp/CutMix soft targets, else the labels (the NLL)
        self._recorded.append((batch["image"][:take].detach().float().cpu(), targets[:take].detach().cpu()))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._due(trainer) or not self._recorded:
            return
        was_training = pl_module.training
        model = self.model(pl_module)  # eval mode (also the EMA copy's); training resumes in train mode below
        device = pl_module.device
        images = torch.cat([x for x, _ in self._recorded])
        targets = torch.cat([t for _, t in self._recorded])
        self._recorded = []
        minibatches = ((images[i : i + self.batch_size].to(device), targets[i : i + self.batch_size].to(device))
                       for i in range(0, len(images), self.batch_size))
        try:
            result = self.spectrum(model, minibatches)
        finally:
            pl_module.train(was_training)
        self.epochs[trainer.current_epoch] = result
        section = {"epochs": {str(e): r for e, r in self.epochs.items()}, "last_epoch": trainer.current_epoch,
                   **{k: result[k] for k in ("nep", "ape", "max_eigenvalue", "min_eigenvalue")},
                   "conditions": self._conditions(model, "augmented training images of the epoch (rank 0)")}
        figure = self._plot({f"epoch {e}": r for e, r in self.epochs.items()}) if self.plot else None
        self.publish(trainer, section, self._metrics(result), figure)

    # ------------------------------------------------------------------------------------------- report
    @staticmethod
    def _metrics(result: dict[str, Any]) -> dict[str, float]:
        return {k: result[k] for k in ("nep", "ape", "max_eigenvalue")}

    def _plot(self, spectra: dict[str, dict[str, Any]]):
        """Histogram (density) of the eigenvalues of each spectrum, as Park & Kim Fig. 4; with several epochs
        the last six are overlaid and NEP / APE are drawn against the epoch."""
        over_epochs = len(spectra) > 1
        figure, axes = new_figure(1, 2 if over_epochs else 1, figsize=(11 if over_epochs else 6, 4), squeeze=False)
        ax = axes[0, 0]
        shown = list(spectra.items())[-6:]
        values = [v for _, r in shown for values in r["minibatches"] for v in values]
        low, high = min(values + [0.0]), max(values + [0.0])
        bins = torch.linspace(low, high + 1e-12, 41).tolist()
        for label, r in shown:
            flat = [v for values in r["minibatches"] for v in values]
            ax.hist(flat, bins=bins, density=True, alpha=0.5,
                    label=f"{label}: NEP {r['nep']:.1%}, APE {r['ape']:.3g}")
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("Hessian max eigenvalue (top-%d per minibatch of %d)" % (self.top_k, self.batch_size))
        ax.set_ylabel("density")
        ax.set_title("Hessian max eigenvalue spectrum")
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
