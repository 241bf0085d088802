"""Hessian max-eigenvalue spectra (Park & Kim Fig. 4): the power iteration against known spectra, and the callback
during fit."""

import json
import math

import pytest
import torch
from lightning import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.func import functional_call

from robust_lightning.analysis.hessian import (
    HessianSpectrum,
    hessian_vector_product,
    minibatch_spectrum,
    spectrum_summary,
    top_eigenvalues,
)
from robust_lightning.data.datamodule import ImageNetDataModule, SyntheticData
from robust_lightning.errors import UserError
from robust_lightning.training.classifier import ImageClassifier


class Quadratic(nn.Module):
    """loss(x) = 0.5 x^T A x: its Hessian is A, whatever x."""

    def __init__(self, a: torch.Tensor):
        super().__init__()
        self.register_buffer("a", a)
        self.x = nn.Parameter(torch.randn(a.shape[0], dtype=a.dtype))

    def forward(self) -> torch.Tensor:
        return 0.5 * self.x @ self.a @ self.x


def rotated(eigenvalues: list[float]) -> torch.Tensor:
    """A symmetric matrix with the given eigenvalues and random (not axis-aligned) eigenvectors."""
    q, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(1)))
    return q @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ q.T


def test_top_eigenvalue_of_a_quadratic_loss_is_the_largest_of_its_matrix():
    loss = Quadratic(rotated([7.0, 2.0, 1.0, 0.5, -0.3]))
    hvp = hessian_vector_product(loss(), list(loss.parameters()))
    values, steps = top_eigenvalues(hvp, 5, top_k=1, max_iter=500, tol=1e-10, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(0))
    assert values[0] == pytest.approx(7.0, rel=1e-6)
    assert steps[0] < 500  # converged, not cut off


def test_deflation_finds_negative_eigenvalues_and_nep_ape_count_them():
    # top-3 by magnitude of {10, -6, 3, 1, 0.5, -0.2} are 10, -6, 3: one negative of three
    loss = Quadratic(rotated([10.0, -6.0, 3.0, 1.0, 0.5, -0.2]))
    hvp = hessian_vector_product(loss(), list(loss.parameters()))
    values, _ = top_eigenvalues(hvp, 6, top_k=3, max_iter=1000, tol=1e-10, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(0))
    assert values == pytest.approx([10.0, -6.0, 3.0], rel=1e-6)
    summary = spectrum_summary(values)
    assert summary["nep"] == pytest.approx(1 / 3)
    assert summary["ape"] == pytest.approx(6.5, rel=1e-6)  # mean of 10 and 3
    assert summary["max_eigenvalue"] == pytest.approx(10.0) and summary["min_eigenvalue"] == pytest.approx(-6.0)
    # the l2 term shifts every eigenvalue by weight_decay
    shifted = hessian_vector_product(loss(), list(loss.parameters()), weight_decay=0.5)
    values, _ = top_eigenvalues(shifted, 6, top_k=1, max_iter=1000, tol=1e-10, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(0))
    assert values[0] == pytest.approx(10.5, rel=1e-6)


def test_spectrum_of_a_small_network_matches_its_full_hessian():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    values, _ = minibatch_spectrum(net, x, y, top_k=3, max_iter=2000, tol=1e-9)

    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def loss(w):
        parts = [c.view(s) for c, s in zip(w.split([s.numel() for s in shapes]), shapes)]
        return nn.functional.cross_entropy(functional_call(net, dict(zip(names, parts)), (x,)), y)

    exact = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss, flat))
    by_magnitude = exact[exact.abs().argsort(descending=True)][:3]
    assert values == pytest.approx(by_magnitude.tolist(), rel=1e-4, abs=1e-6)
    # soft one-hot targets (the MixUp path of the fit-time callback) give the same loss, hence the same spectrum
    soft = nn.functional.one_hot(y, 3).double()
    assert minibatch_spectrum(net, x, soft, top_k=3, max_iter=2000, tol=1e-9)[0] == pytest.approx(values, rel=1e-6)


def test_minibatch_spectrum_leaves_the_model_as_it_found_it():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, 3)).eval()
    net[0].weight.requires_grad_(False)  # like the EMA copy's weights
    stats = net[1].running_mean.clone()
    minibatch_spectrum(net, torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]), top_k=2, max_iter=5)
    assert not net[0].weight.requires_grad and net[0].bias.requires_grad
    assert all(p.grad is None for p in net.parameters())  # parameters' .grad untouched: safe during fit
    assert torch.equal(net[1].running_mean, stats)


def test_vision_transformers_work_although_fused_attention_has_no_double_backward():
    import timm

    torch.manual_seed(0)
    vit = timm.create_model("test_vit", num_classes=3, img_size=32, patch_size=8).eval()
    values, _ = minibatch_spectrum(vit, torch.rand(2, 3, 32, 32), torch.tensor([0, 1]), top_k=1, max_iter=2)
    assert math.isfinite(values[0])


def test_bad_settings_are_refused():
    with pytest.raises(UserError, match="top_k"):
        HessianSpectrum(top_k=0)
    with pytest.raises(UserError, match="weight_decay"):
        HessianSpectrum(weight_decay=-1.0)


def test_the_callback_writes_a_spectrum_per_epoch_during_fit(tmp_path):
    data = ImageNetDataModule(source="synthetic", image_size=32, batch_size=8, num_workers=0, augmentation="heavy",
                              synthetic=SyntheticData(num_classes=4, train_per_class=8, val_per_class=2, image_size=32,
                                                      root=str(tmp_path / "synthetic")))
    torch.manual_seed(0)
    module = ImageClassifier(arch="test_resnet", num_classes=4, image_size=32, warmup_epochs=0)
    hessian = HessianSpectrum(top_k=2, max_iter=4, max_images=8, batch_size=4, every_n_epochs=1)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=2, limit_val_batches=1,
                      num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, logger=CSVLogger(tmp_path, name="fit"), callbacks=[hessian])
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4  # training went on after each analysis
    run = tmp_path / "fit" / "version_0"
    section = json.loads((run / "results.json").read_text())["hessian"]
    assert set(section["epochs"]) == {"0", "1"} and section["last_epoch"] == 1
    for spectrum in section["epochs"].values():
        assert len(spectrum["minibatches"]) == 2 and all(len(v) == 2 for v in spectrum["minibatches"])
        assert 0.0 <= spectrum["nep"] <= 1.0
    assert "augmented training images" in section["conditions"]["data"]
    assert (run / "hessian.png").is_file() and section["plot"].endswith("hessian.png")
