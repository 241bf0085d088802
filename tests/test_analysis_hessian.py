"""Hessian max-eigenvalue spectra (Park & Kim Fig. 4): the power iteration against known spectra, the paper's
protocol at test time (augmented training images, 10% of the training set, the model's weight decay), and the
callback during fit."""

import io
import json
import math
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from lightning import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from torch import nn
from torch.func import functional_call

from robust_lightning.analysis import hessian as hessian_module
from robust_lightning.analysis.hessian import (
    HessianSpectrum,
    hessian_vector_product,
    minibatch_spectrum,
    spectrum_summary,
    top_eigenvalues,
)
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import SyntheticSource
from robust_lightning.data.transforms import eval_transform
from robust_lightning.errors import UserError
from robust_lightning.training.lightning_module import ImageClassifier


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
    q, _ = torch.linalg.qr(
        torch.randn(len(eigenvalues), len(eigenvalues), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    )
    return q @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ q.T


def test_top_eigenvalue_of_a_quadratic_loss_is_the_largest_of_its_matrix():
    loss = Quadratic(rotated([7.0, 2.0, 1.0, 0.5, -0.3]))
    hvp = hessian_vector_product(loss(), list(loss.parameters()))
    values, steps = top_eigenvalues(
        hvp, 5, top_k=1, max_iter=500, tol=1e-10, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    assert values[0] == pytest.approx(7.0, rel=1e-6)
    assert steps[0] < 500  # converged, not cut off


def test_the_power_iterations_ask_their_stop_point_every_10_products_across_eigenvalues():
    """One minibatch is up to top_k x max_iter Hessian-vector products (500 with the paper's settings, minutes on a
    large model): the stop point is asked every 10 of them, counted across the eigenvalues, and raises to stop."""
    loss = Quadratic(rotated([7.0, 2.0, 1.0, 0.5, -0.3]))
    products = []
    product = hessian_vector_product(loss(), list(loss.parameters()))

    def hvp(v):
        products.append(1)
        return product(v)

    asked = []
    settings = {"top_k": 3, "max_iter": 8, "tol": 1e-12, "dtype": torch.float64}
    top_eigenvalues(hvp, 5, **settings, stop_point=lambda: asked.append(len(products)))
    assert len(products) == 24 and asked == [10, 20]

    class Stopped(Exception):
        pass

    def stop():
        raise Stopped

    products.clear()
    with pytest.raises(Stopped):
        top_eigenvalues(hvp, 5, **settings, stop_point=stop)
    assert len(products) == 10


def test_deflation_finds_negative_eigenvalues_and_nep_ape_count_them():
    # top-3 by magnitude of {10, -6, 3, 1, 0.5, -0.2} are 10, -6, 3: one negative of three
    loss = Quadratic(rotated([10.0, -6.0, 3.0, 1.0, 0.5, -0.2]))
    hvp = hessian_vector_product(loss(), list(loss.parameters()))
    values, _ = top_eigenvalues(
        hvp, 6, top_k=3, max_iter=1000, tol=1e-10, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    assert values == pytest.approx([10.0, -6.0, 3.0], rel=1e-6)
    summary = spectrum_summary(values)
    assert summary["nep"] == pytest.approx(1 / 3)
    assert summary["ape"] == pytest.approx(6.5, rel=1e-6)  # mean of 10 and 3
    assert summary["max_eigenvalue"] == pytest.approx(10.0) and summary["min_eigenvalue"] == pytest.approx(-6.0)
    # the l2 term shifts every eigenvalue by weight_decay
    shifted = hessian_vector_product(loss(), list(loss.parameters()), weight_decay=0.5)
    values, _ = top_eigenvalues(
        shifted, 6, top_k=1, max_iter=1000, tol=1e-10, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
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
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    ).eval()
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
    data = ImageNetDataModule(
        source=SyntheticSource(
            num_classes=4, train_per_class=8, val_per_class=2, image_size=32, root=str(tmp_path / "synthetic")
        ),
        image_size=32,
        batch_size=8,
        num_workers=0,
        augmentation="heavy",
    )
    torch.manual_seed(0)
    module = ImageClassifier(arch="test_resnet", num_classes=4, image_size=32, warmup_epochs=0)
    hessian = HessianSpectrum(top_k=2, max_iter=4, max_images=8, batch_size=4, every_n_epochs=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(tmp_path, name="fit"),
        callbacks=[hessian],
    )
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


# ------------------------------------------------------------------------------- the paper's protocol at test time
@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synthetic")  # 4 classes x 10 training images, generated by the first use


def datamodule(root: Path, **kwargs) -> ImageNetDataModule:
    """4 classes, 40 training and 8 evaluation images of 64 px, trained and evaluated at 32 px."""
    synthetic = SyntheticSource(num_classes=4, train_per_class=10, val_per_class=2, image_size=64, root=str(root))
    options = {"source": synthetic, "image_size": 32, "batch_size": 8, "num_workers": 0, "augmentation": "basic"}
    return ImageNetDataModule(**{**options, **kwargs})


def raw_training_images(root: Path) -> dict[str, Image.Image]:
    """The training images as written in the shards, by key (read with tarfile, not the data pipeline)."""
    images = {}
    for shard in sorted((root / "train").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".jpg"):
                    images[member.name.removesuffix(".jpg")] = Image.open(io.BytesIO(tar.extractfile(member).read()))
    return images


def as_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32)).permute(2, 0, 1) / 255


class Spy:
    """Records the batches the data module's training_sample yields and the minibatches the spectrum is
    computed on."""

    def __init__(self, monkeypatch):
        self.yielded, self.analysed, self.samples = [], [], []
        original_sample, original_spectrum = ImageNetDataModule.training_sample, hessian_module.minibatch_spectrum

        def training_sample(data, *args, **kwargs):
            sample = original_sample(data, *args, **kwargs)
            self.samples.append(sample)
            return sample._replace(batches=self._record(sample.batches))

        def minibatch_spectrum(model, images, targets, **kwargs):
            self.analysed.append((images.detach().clone(), targets.detach().clone(), kwargs))
            return original_spectrum(model, images, targets, **kwargs)

        monkeypatch.setattr(ImageNetDataModule, "training_sample", training_sample)
        monkeypatch.setattr(hessian_module, "minibatch_spectrum", minibatch_spectrum)

    def _record(self, batches):
        for batch in batches:
            self.yielded.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
            yield batch


def run_test(tmp_path: Path, data: ImageNetDataModule, hessian: HessianSpectrum, **model_args) -> dict:
    """robust-lightning test's loop on a tiny untrained model; returns results.json's "hessian" section."""
    seed_everything(0)
    module = ImageClassifier(arch="test_resnet", num_classes=4, image_size=32, warmup_epochs=0, **model_args)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        inference_mode=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(tmp_path, name="test"),
        default_root_dir=tmp_path,  # where the minibatches are saved (not the working directory's runs/)
        callbacks=[hessian],
    )
    trainer.test(module, datamodule=data, verbose=False)
    return json.loads((tmp_path / "test" / "version_0" / "results.json").read_text())["hessian"]


def test_training_sample_is_a_seeded_fraction_of_the_augmented_training_set(synthetic_root):
    data = datamodule(synthetic_root, augmentation="3aug")
    data.setup("test")
    evaluation = data.eval_set
    sample = data.training_sample("cpu", fraction=0.1, batch_size=3, seed=0)
    batches = list(sample.batches)
    raw = raw_training_images(synthetic_root)
    assert sample.training_images == len(raw) == 40 and sample.subset_images == sample.images == 4  # 10% of 40
    assert [len(b["label"]) for b in batches] == [3, 1]
    keys = [k for b in batches for k in b["key"]]
    assert len(set(keys)) == 4 and set(keys) <= set(raw)  # distinct training images
    for batch in batches:
        assert batch["image"].dtype == torch.float32 and batch["image"].shape[1:] == (3, 32, 32)
        assert batch["image"].min() >= 0 and batch["image"].max() <= 1
    # the test run's data stay as they were: its evaluation set, and no training set of its own
    assert data.eval_set is evaluation and data.train_set is None

    # the subset is fixed by the seed; the cap takes the first images of the same subset
    def keys_of(seed: int) -> list[str]:
        return [k for b in data.training_sample("cpu", fraction=0.1, batch_size=3, seed=seed).batches for k in b["key"]]

    assert keys_of(0) == keys and keys_of(1) != keys
    capped = data.training_sample("cpu", fraction=0.5, max_images=3, batch_size=2, seed=0)
    assert (capped.subset_images, capped.images) == (20, 3)
    assert sum(len(b["label"]) for b in capped.batches) == 3
    with pytest.raises(UserError, match="fraction"):
        data.training_sample("cpu", fraction=0.0)


def test_the_hessian_minibatches_come_from_the_training_transform(tmp_path, synthetic_root, monkeypatch):
    # crop_scale (1, 1) on square images makes the training crop the whole image: the training transform is
    # then a plain bicubic resize 64 -> 32 (no flip in 'basic'), while evaluation resizes to 36 and centre-crops
    data = datamodule(synthetic_root, crop_scale=(1.0, 1.0))
    spy = Spy(monkeypatch)
    hessian = HessianSpectrum(top_k=1, max_iter=2, batch_size=4, plot=False)  # data "train", 10%: the defaults
    section = run_test(tmp_path, data, hessian)

    assert len(spy.samples) == len(spy.yielded) == len(spy.analysed) == 1  # 4 images (10% of 40): one minibatch
    assert all(torch.equal(images, batch["image"]) for (images, _, _), batch in zip(spy.analysed, spy.yielded))
    raw = raw_training_images(synthetic_root)
    for batch in spy.yielded:
        for key, image in zip(batch["key"], batch["image"]):
            training = as_tensor(raw[key].resize((32, 32), Image.BICUBIC))
            evaluation = eval_transform(32, data.crop_pct)(raw[key]).float() / 255
            assert (image - training).abs().max() <= 2 / 255 + 1e-6  # Pillow's fixed-point rounding
            assert (image - evaluation).abs().mean() > 5 / 255  # not the evaluation preprocessing
    # hard labels and label smoothing 0.1: the smoothed one-hot targets of the training loss
    targets = torch.cat([t for _, t, _ in spy.analysed])
    labels = torch.cat([b["label"] for b in spy.yielded])
    assert torch.allclose(targets, nn.functional.one_hot(labels, 4).float() * 0.9 + 0.1 / 4)

    assert section["comparable_with_paper"] is True and section["images"] == 4
    protocol = section["protocol"]
    assert (protocol["train_fraction"], protocol["training_images"], protocol["subset_images"]) == (0.1, 40, 4)
    assert (protocol["minibatch_size"], protocol["top_k"], protocol["augmentation"]) == (4, 1, "basic")
    assert section["conditions"]["images"] == 4 and "training set" in section["conditions"]["data"]


def test_heavy_augmentation_gives_mixup_soft_targets_and_the_l2_term_is_the_models_weight_decay(
    tmp_path, synthetic_root, monkeypatch
):
    data = datamodule(synthetic_root, augmentation="heavy")
    spy = Spy(monkeypatch)
    hessian = HessianSpectrum(train_fraction=0.25, max_images=4, top_k=1, max_iter=2, batch_size=4, plot=False)
    section = run_test(tmp_path, data, hessian, weight_decay=0.125)
    ((_, targets, kwargs),) = spy.analysed
    (batch,) = spy.yielded
    assert targets.shape == (4, 4) and torch.equal(targets, batch["target"])
    assert torch.allclose(targets.sum(1), torch.ones(4))
    # mixed: some image's target is not the smoothed one-hot of its own label
    smoothed = nn.functional.one_hot(batch["label"], 4).float() * 0.9 + 0.1 / 4
    assert not torch.allclose(targets, smoothed)
    assert section["protocol"]["mixup_cutmix"] is True and section["protocol"]["augmentation"] == "heavy"
    # weight_decay null: the model's training weight decay is the l2 term
    assert kwargs["weight_decay"] == 0.125
    assert section["conditions"]["weight_decay"] == section["protocol"]["weight_decay"] == 0.125
    assert section["protocol"]["weight_decay_from"] == "the model's hparams"
    # max_images cut the 25% subset (10 of 40 images) short: a sample of the protocol, said so
    assert section["images"] == 4 and section["protocol"]["subset_images"] == 10
    assert section["comparable_with_paper"] is False and "4 of the 10 images" in section["comparability"]


def test_a_weight_decay_set_wins_and_a_model_without_one_needs_it_set():
    module = SimpleNamespace(hparams={"weight_decay": 0.125})
    assert HessianSpectrum().model_weight_decay(module) == 0.125
    assert HessianSpectrum(weight_decay=0.0).model_weight_decay(module) == 0.0
    with pytest.raises(UserError, match="weight_decay"):
        HessianSpectrum().model_weight_decay(SimpleNamespace(hparams={}))


def test_evaluation_images_are_flagged_not_comparable_with_the_paper(tmp_path, synthetic_root, monkeypatch):
    spy = Spy(monkeypatch)
    hessian = HessianSpectrum(data="eval", max_images=4, top_k=1, max_iter=2, batch_size=4, plot=False)
    section = run_test(tmp_path, datamodule(synthetic_root), hessian)
    assert not spy.samples and len(spy.analysed) == 1
    assert section["comparable_with_paper"] is False and "clean evaluation images" in section["comparability"]
    assert "protocol" not in section and section["conditions"]["data"] == "evaluation images, no augmentation"


def test_protocol_settings_are_checked():
    with pytest.raises(UserError, match="data"):
        HessianSpectrum(data="test")
    with pytest.raises(UserError, match="train_fraction"):
        HessianSpectrum(train_fraction=1.5)
    with pytest.raises(UserError, match="max_images"):
        HessianSpectrum(max_images=0)
    module = SimpleNamespace(hparams={"weight_decay": 0.05})
    with pytest.raises(UserError, match="during fit"):  # fit records max_images images per epoch
        HessianSpectrum().setup(SimpleNamespace(world_size=1), module, "fit")


def test_the_shipped_config_runs_the_papers_protocol():
    configs = Path(__file__).parents[1] / "configs"
    config = yaml.safe_load((configs / "analysis" / "hessian_parkkim_fig4.yaml").read_text())
    callback = config["trainer"]["callbacks"][0]
    assert callback["class_path"] == "robust_lightning.analysis.hessian.HessianSpectrum"
    args = callback["init_args"]
    assert (args["data"], args["train_fraction"], args["batch_size"], args["top_k"]) == ("train", 0.1, 16, 5)
    assert args["weight_decay"] is None and args["max_images"] == 64  # the model's weight decay; a CPU-sized cap
    assert config["ckpt_path"] == "runs/quickstart_vit/checkpoints/last.ckpt"  # Fig. 4's ViT family
    quickstart = yaml.safe_load((configs / "quickstart_vit.yaml").read_text())
    # the quickstart ViT's training data and transform, which the checkpoint was trained with
    keys = ("source", "image_size", "crop_scale", "augmentation")
    assert {k: config["data"][k] for k in keys} == {k: quickstart["data"][k] for k in keys}
