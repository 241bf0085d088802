"""Resolution sweep: ViT position-embedding interpolation on a copy, the preprocessing at each resolution, clean
accuracy against a direct computation, radius scaling, the choice of the best resolution, resume and refusal,
and the plot. Tiny models on a 12-image folder tree (40 x 48 JPEGs), resolutions 16-48 px."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning import Trainer
from PIL import Image
from timm.layers import resample_abs_pos_embed
from torch import nn
from torchvision.transforms.v2.functional import pil_to_tensor

from helpers import WNIDS, make_image_tree
from robust_lightning.attacks.ensemble import AutoAttack
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import FolderSource
from robust_lightning.data.transforms import eval_transform
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import ThreatModel, read_outcomes
from robust_lightning.evaluation.resolution import (
    ResolutionSweep,
    best_resolutions,
    check_runs_at,
    interpolate_pos_embed_singh,
    network_at,
    scaled_eps,
)
from robust_lightning.job_signals import JobSignals, JobStopped
from robust_lightning.training.lightning_module import ImageClassifier

LINF = {"norm": "Linf", "eps": 4 / 255}
TINY_VIT = dict(arch="vit_tiny_patch16_224", arch_kwargs=dict(patch_size=8, depth=1, embed_dim=32, num_heads=2))
TINY_CNN = dict(arch="test_resnet")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep-data")
    make_image_tree(root / "train", {w: 1 for w in WNIDS})
    make_image_tree(root / "val", {w: 4 for w in WNIDS})  # 12 images, 40 x 48
    return root


def datamodule(tree: Path) -> ImageNetDataModule:
    return ImageNetDataModule(
        source=FolderSource(str(tree), class_map="folders"), image_size=32, eval_batch_size=4, num_workers=0
    )


def val_files(tree: Path) -> list[Path]:
    return sorted((tree / "val").glob("*/*.JPEG"))  # the folder dataset's order: class folder, then file name


def save_checkpoint(module: ImageClassifier, path: Path) -> Path:
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def cnn_checkpoints(tree, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny CNN fitted to the val images at 32 px (so some are right, and more so at 32 than at 16), and a
    second checkpoint with other weights."""
    directory = tmp_path_factory.mktemp("sweep-ckpt")
    files = val_files(tree)
    x = torch.stack([eval_transform(32)(Image.open(f)) for f in files]).float() / 255
    y = torch.tensor([WNIDS.index(f.parent.name) for f in files])
    torch.manual_seed(0)
    module = ImageClassifier(num_classes=3, image_size=32, **TINY_CNN)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    for _ in range(25):
        optimizer.zero_grad()
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
    first = save_checkpoint(module, directory / "cnn.ckpt")
    with torch.no_grad():
        module.model.net.fc.bias.add_(0.5)
    return first, save_checkpoint(module, directory / "cnn-other.ckpt")


@pytest.fixture(scope="module")
def vit_checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    module = ImageClassifier(num_classes=3, image_size=32, **TINY_VIT)
    return save_checkpoint(module, tmp_path_factory.mktemp("sweep-vit") / "vit.ckpt")


def run_sweep(
    tmp_path: Path, tree: Path, checkpoint: Path, model: dict = TINY_CNN, **options
) -> tuple[dict, ImageClassifier]:
    """``test`` with the sweep; returns the resolution_sweep section of results.json and the module after it."""
    options.setdefault("results_dir", str(tmp_path / "outcomes"))
    module = ImageClassifier(num_classes=3, image_size=32, **model)
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path / "run"),
        callbacks=[ResolutionSweep(**options)],
    )
    trainer.test(module, datamodule=datamodule(tree), ckpt_path=str(checkpoint), verbose=False, weights_only=True)
    return json.loads((tmp_path / "run" / "results.json").read_text())["resolution_sweep"], module


def load(checkpoint: Path, model: dict) -> ImageClassifier:
    module = ImageClassifier(num_classes=3, image_size=32, **model)
    module.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    return module.eval()


# ------------------------------------------------------------------------------------------- input size
def test_vit_position_embeddings_are_interpolated_on_a_copy():
    torch.manual_seed(0)
    for model, patch in (
        (TINY_VIT, 8),
        (dict(arch="vit_small_patch16_224_convstem", arch_kwargs=dict(depth=1, embed_dim=64, num_heads=2)), 16),
    ):
        network = ImageClassifier(num_classes=3, image_size=32, **model).model.eval()
        before = {k: v.clone() for k, v in network.state_dict().items()}
        x = torch.rand(2, 3, 32, 32)
        assert network_at(network, 32) is network  # at the trained size: the model itself, output unchanged
        r = 3 * patch
        resized = network_at(network, r, pos_embed_interpolation="timm")
        grid = (r // patch, r // patch)
        assert resized is not network and resized.net.patch_embed.grid_size == grid
        assert resized.net.pos_embed.shape == (1, 1 + grid[0] * grid[1], network.net.embed_dim)
        expected = resample_abs_pos_embed(
            network.net.pos_embed, new_size=grid, old_size=(32 // patch,) * 2, num_prefix_tokens=1
        )
        assert torch.equal(resized.net.pos_embed, expected)
        # the default is Singh et al.'s interpolation (tested against a direct bicubic below): not timm's
        singh = network_at(network, r)
        assert singh.net.patch_embed.grid_size == grid and not torch.allclose(singh.net.pos_embed, expected)
        assert torch.equal(singh.net.pos_embed[:, 0], network.net.pos_embed[:, 0])  # the class token's is kept
        assert resized(torch.rand(2, 3, r, r)).shape == (2, 3)
        # the original is untouched: same weights, same grid, same outputs
        assert network.net.patch_embed.grid_size == (32 // patch,) * 2
        assert all(torch.equal(v, before[k]) for k, v in network.state_dict().items())
        with torch.no_grad():
            assert torch.equal(network(x), network_at(network, 32)(x))
    with pytest.raises(UserError, match="not a multiple of the model's patch size"):
        network_at(ImageClassifier(num_classes=3, image_size=32, **TINY_VIT).model, 36)


def bicubic_numpy(grid: np.ndarray, out: int, scale: float, a: float = -0.75) -> np.ndarray:
    """Separable bicubic resize of an (n, n, C) array to (out, out, C): Keys' cubic convolution with a = -0.75,
    source coordinate (dst + 0.5) / scale - 0.5 (half-pixel centres), taps clamped at the borders."""

    def kernel(x):
        x = abs(x)
        if x <= 1:
            return ((a + 2) * x - (a + 3)) * x * x + 1
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a if x < 2 else 0.0

    n = grid.shape[0]
    weights = np.zeros((out, n))
    for dst in range(out):
        src = (dst + 0.5) / scale - 0.5
        base = int(np.floor(src))
        for tap in range(base - 1, base + 3):
            weights[dst, min(max(tap, 0), n - 1)] += kernel(src - tap)
    return np.einsum("ij,jkc,lk->ilc", weights, grid, weights)


def test_singh_position_embedding_interpolation_is_a_direct_bicubic_with_the_dino_scale_factor():
    torch.manual_seed(0)
    dim, old, new = 5, 4, 7
    pos_embed = torch.randn(1, 1 + old * old, dim, dtype=torch.float64)
    ours = interpolate_pos_embed_singh(pos_embed, (old, old), (new, new), num_prefix_tokens=1)
    expected = bicubic_numpy(pos_embed[0, 1:].reshape(old, old, dim).numpy(), new, (new + 0.1) / old)
    assert ours.shape == (1, 1 + new * new, dim) and torch.equal(ours[:, 0], pos_embed[:, 0])
    assert np.allclose(ours[0, 1:].reshape(new, new, dim).numpy(), expected, atol=1e-12)
    # timm's resampling to the exact size differs (size ratio 7/4, not 7.1/4)
    timm = resample_abs_pos_embed(pos_embed.float(), new_size=(new, new), old_size=(old, old), num_prefix_tokens=1)
    assert not torch.allclose(ours.float(), timm, atol=1e-3)


def test_convnets_need_nothing_and_fixed_size_models_are_refused():
    cnn = ImageClassifier(num_classes=3, image_size=32, **TINY_CNN).model.eval()
    assert network_at(cnn, 48) is cnn
    check_runs_at(cnn, 48, torch.device("cpu"), "test_resnet")
    fixed = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3))
    assert network_at(fixed, 16) is fixed
    with pytest.raises(UserError, match="cannot run at 16 x 16 px"):
        check_runs_at(fixed, 16, torch.device("cpu"), "mlp")


# ------------------------------------------------------------------------------------------- the sweep
def manual_preprocessing(path: Path, r: int) -> torch.Tensor:
    """The paper's preprocessing written out with PIL: shorter side to floor(r / 0.875) bicubic, centre crop r."""
    image = Image.open(path).convert("RGB")
    w, h = image.size
    short = math.floor(r / 0.875)
    size = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    image = image.resize(size, Image.BICUBIC)
    left, top = round((size[0] - r) / 2), round((size[1] - r) / 2)
    return pil_to_tensor(image.crop((left, top, left + r, top + r)))


def test_clean_accuracy_and_preprocessing_at_each_resolution(tmp_path, tree, cnn_checkpoints, monkeypatch):
    fed: dict[tuple[int, str], torch.Tensor] = {}
    original = ResolutionSweep._evaluate

    def spy(self, model, cell, images, labels, keys, index, device):
        for i in index:
            fed[cell.resolution, keys[i]] = images[i].clone()
        return original(self, model, cell, images, labels, keys, index, device)

    monkeypatch.setattr(ResolutionSweep, "_evaluate", spy)
    resolutions = [16, 24, 32, 40]
    section, module = run_sweep(tmp_path, tree, cnn_checkpoints[0], resolutions=resolutions, attack=None, batch_size=5)
    reference = load(cnn_checkpoints[0], TINY_CNN)
    files = val_files(tree)
    labels = torch.tensor([WNIDS.index(f.parent.name) for f in files])
    accuracies = {}
    for r in resolutions:
        x = torch.stack([manual_preprocessing(f, r) for f in files])
        for f, image in zip(files, x):
            assert torch.equal(image, eval_transform(r)(Image.open(f)))
            assert torch.equal(fed[r, f.stem], image.float() / 255)  # what the sweep fed the model
        with torch.no_grad():
            correct = reference(x.float() / 255).argmax(1) == labels
        outcomes = read_outcomes(tmp_path / "outcomes" / f"{r}px" / "clean")
        assert {k: o["clean"] for k, o in outcomes.items()} == dict(zip([f.stem for f in files], correct.tolist()))
        entry = section["resolutions"][str(r)]
        assert entry["num_images"] == 12 and entry["clean_correct"] == int(correct.sum())
        assert entry["clean_accuracy"] == correct.sum().item() / 12 and entry["resize"] == math.floor(r / 0.875)
        accuracies[r] = entry["clean_accuracy"]
    assert 0 < min(accuracies.values()) < max(accuracies.values())  # not vacuous: resolutions differ
    best = max(resolutions, key=lambda r: (accuracies[r], -r))
    assert section["best"] == {"by_robust": None, "by_clean": {"resolution": best, "clean_accuracy": accuracies[best]}}
    assert section["conditions"]["reference_resolution"] == 32 and section["conditions"]["attack"] is None
    plot = tmp_path / "run" / "resolution_sweep.png"
    assert section["plot"] == str(plot.resolve()) and plot.stat().st_size > 5000
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in module.state_dict().items())


def test_vit_sweep_leaves_the_model_as_it_found_it(tmp_path, tree, vit_checkpoint):
    """A ViT swept over its sizes, and over one its patches cannot split (36 px), which is skipped with its
    reason, in results.json and a warning, while the others run."""
    with pytest.warns(UserWarning, match="36 px skipped: resolution 36 is not a multiple of the model's patch size"):
        section, module = run_sweep(
            tmp_path,
            tree,
            vit_checkpoint,
            TINY_VIT,
            resolutions=[16, 32, 36, 48],
            threat_models=[LINF],
            attack="apgd-ce",
            n_iter=2,
            max_images=5,
        )
    assert set(section["resolutions"]) == {"16", "32", "48"}
    skipped = section["skipped_resolutions"]
    assert list(skipped) == ["36"] and "use multiples of 8" in skipped["36"]
    with pytest.raises(UserError, match=r"runs at none of the resolutions \[36, 44\]"):
        run_sweep(tmp_path / "none", tree, vit_checkpoint, TINY_VIT, resolutions=[36, 44], attack=None)
    reference = load(vit_checkpoint, TINY_VIT)
    state = module.state_dict()
    assert state.keys() == reference.state_dict().keys()
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in state.items())
    assert module.model.net.patch_embed.img_size == (32, 32) and module.model.net.pos_embed.shape == (1, 17, 32)
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(module.eval()(x), reference(x))
    first_five = {f.stem for f in val_files(tree)[:5]}
    for r in (16, 32, 48):
        entry = section["resolutions"][str(r)]
        assert entry["num_images"] == 5 and entry["threat_models"]["Linf-4_255"]["num_points"] == 5
        assert set(read_outcomes(tmp_path / "outcomes" / f"{r}px" / "Linf-4_255")) == first_five
    assert "set_input_size" in section["conditions"]["input_size"]


def test_radii_are_scaled_with_resolution_and_recorded(tmp_path, tree, cnn_checkpoints, monkeypatch):
    used = set()
    original = AutoAttack.evaluate

    def spy(self, x, y, bs=250, **options):
        used.add((x.shape[-1], self.norm, self.eps))
        return original(self, x, y, bs=bs, **options)

    monkeypatch.setattr(AutoAttack, "evaluate", spy)
    threats = [LINF, {"norm": "L2", "eps": 0.5}, {"norm": "L1", "eps": 3.0}]
    section, _ = run_sweep(
        tmp_path,
        tree,
        cnn_checkpoints[0],
        resolutions=[16, 32],
        threat_models=threats,
        attack="apgd-ce",
        n_iter=3,
        max_images=4,
        scale_l2_with_resolution=True,
        scale_l1_with_resolution=True,
    )
    expected = {
        16: {"Linf-4_255": 4 / 255, "L2-0.5": 0.25, "L1-3": 0.75},
        32: {"Linf-4_255": 4 / 255, "L2-0.5": 0.5, "L1-3": 3.0},
    }
    for r, radii in expected.items():
        entry = section["resolutions"][str(r)]["threat_models"]
        assert {name: entry[name]["eps"] for name in radii} == radii
        nominal = {name: entry[name]["eps_nominal"] for name in radii}
        assert nominal == {"Linf-4_255": 4 / 255, "L2-0.5": 0.5, "L1-3": 3.0}
    assert used == {(r, name.split("-")[0], eps) for r, radii in expected.items() for name, eps in radii.items()}
    # unscaled unless asked
    assert scaled_eps(ThreatModel("L2", 2.0), 448, 224, False, True) == 2.0
    assert scaled_eps(ThreatModel("L1", 75.0), 448, 224, True, False) == 75.0
    assert scaled_eps(ThreatModel("Linf", 4 / 255), 448, 224, True, True) == 4 / 255


def test_best_resolution_by_robust_accuracy_with_clean_as_tie_break():
    rows = {
        224: {"clean_accuracy": 0.72, "robust_accuracy": {"Linf": 0.49, "L2": 0.30}},
        256: {"clean_accuracy": 0.74, "robust_accuracy": {"Linf": 0.50, "L2": 0.31}},
        288: {"clean_accuracy": 0.75, "robust_accuracy": {"Linf": 0.50, "L2": 0.33}},  # tie on Linf: more clean
        320: {"clean_accuracy": 0.75, "robust_accuracy": {"Linf": 0.48, "L2": 0.29}},  # tie on clean: smaller wins
        384: {"clean_accuracy": None, "robust_accuracy": {"Linf": None, "L2": None}},  # no images evaluated
    }
    best = best_resolutions(rows, "Linf")
    assert best["by_robust"] == {
        "threat_model": "Linf",
        "resolution": 288,
        "robust_accuracy": 0.50,
        "clean_accuracy": 0.75,
    }
    assert best["by_clean"] == {"resolution": 288, "clean_accuracy": 0.75}
    assert best_resolutions(rows, "L2")["by_robust"]["resolution"] == 288
    rows[256]["robust_accuracy"]["Linf"] = 0.51
    assert best_resolutions(rows, "Linf")["by_robust"]["resolution"] == 256
    assert best_resolutions(rows, None)["by_robust"] is None  # clean-only sweep


def test_resume_skips_finished_cells_and_refuses_another_checkpoint(tmp_path, tree, cnn_checkpoints, monkeypatch):
    calls: list[tuple[int, int]] = []
    original = AutoAttack.evaluate
    interrupt = {"at": 2}  # kill the first run at its 2nd attack at 24 px

    def spy(self, x, y, bs=250, **options):
        calls.append((x.shape[-1], len(x)))
        if sum(r == 24 for r, _ in calls) == interrupt["at"]:
            raise RuntimeError("interrupted")
        return original(self, x, y, bs=bs, **options)

    monkeypatch.setattr(AutoAttack, "evaluate", spy)
    options = dict(resolutions=[16, 24], threat_models=[LINF], attack="apgd-ce", n_iter=2, batch_size=4)
    with pytest.raises(RuntimeError, match="interrupted"):
        run_sweep(tmp_path, tree, cnn_checkpoints[0], **options)
    outcomes = tmp_path / "outcomes"
    assert (outcomes / "16px" / "Linf-4_255" / "done.json").is_file()
    assert not (outcomes / "24px" / "Linf-4_255" / "done.json").is_file()
    assert len(read_outcomes(outcomes / "24px" / "Linf-4_255")) == 4

    calls.clear()
    interrupt["at"] = -1
    section, _ = run_sweep(tmp_path, tree, cnn_checkpoints[0], **options)
    assert calls == [(24, 4), (24, 4)]  # 16 px complete: skipped; 24 px: only the 8 images not done
    for r in (16, 24):
        assert section["resolutions"][str(r)]["threat_models"]["Linf-4_255"]["num_points"] == 12
        assert section["resolutions"][str(r)]["num_images"] == 12
    lines = (outcomes / "24px" / "Linf-4_255" / "rank0.jsonl").read_text().splitlines()
    keys = [k for line in lines for k in json.loads(line)["key"]]
    assert len(keys) == len(set(keys)) == 12  # no image attacked twice

    calls.clear()
    again, _ = run_sweep(tmp_path, tree, cnn_checkpoints[0], **options)
    assert calls == [] and again["resolutions"] == section["resolutions"]

    with pytest.raises(UserError, match="weights_sha256"):
        run_sweep(tmp_path, tree, cnn_checkpoints[1], **options)
    with pytest.raises(UserError, match="n_iter"):
        run_sweep(tmp_path, tree, cnn_checkpoints[0], **{**options, "n_iter": 3})
    assert calls == []


def test_a_stop_inside_an_attack_ends_the_sweep_at_that_batch_and_the_same_run_finishes_it(
    tmp_path, tree, cnn_checkpoints, monkeypatch
):
    """A job's signal noted while a robust cell's attack runs (SIGTERM in the middle of AutoAttack) stops that
    attack at its next stop point and the sweep at its batch: the command ends with JobStopped, the batches before
    it kept and that batch not recorded. The same sweep again evaluates only the images left, and ends with the
    figures of the sweep left alone. In the test's process, as the file's other sweeps (run_sweep: no progress bar
    or loader workers, which the stop inside an attack does not pass through); the signal is the flag that the
    command's SIGTERM handler sets. tests/test_evaluation_stops.py sends real signals to commands."""
    calls: list[int] = []
    signal_at = {"call": 0}  # 0: no signal
    original = AutoAttack.evaluate

    def spy(self, x, y, bs=250, **options):
        calls.append(len(x))
        if len(calls) == signal_at["call"]:
            monkeypatch.setattr(JobSignals, "sigterm", True)  # what the SIGTERM handler notes
        return original(self, x, y, bs=bs, **options)

    monkeypatch.setattr(AutoAttack, "evaluate", spy)
    options = dict(resolutions=[16], threat_models=[LINF], attack="apgd-ce", n_iter=2, batch_size=4)
    alone, _ = run_sweep(tmp_path / "alone", tree, cnn_checkpoints[0], **options)
    calls.clear()
    signal_at["call"] = 2
    with pytest.raises(JobStopped):
        run_sweep(tmp_path, tree, cnn_checkpoints[0], **options)
    assert calls == [4, 4]
    assert len(read_outcomes(tmp_path / "outcomes" / "16px" / "Linf-4_255")) == 4  # the first batch's, not the second's
    monkeypatch.setattr(JobSignals, "sigterm", False)
    calls.clear()
    signal_at["call"] = 0
    section, _ = run_sweep(tmp_path, tree, cnn_checkpoints[0], **options)
    assert calls == [4, 4]  # the second and third batches

    def figures(sweep: dict) -> dict:  # without the seconds the attacks took
        return {r: {k: v for k, v in row.items() if k != "seconds"} for r, row in sweep["resolutions"].items()}

    assert figures(section) == figures(alone)


def test_a_run_on_more_images_only_evaluates_the_new_ones(tmp_path, tree, cnn_checkpoints, monkeypatch):
    calls: list[int] = []
    original = AutoAttack.evaluate

    def spy(self, x, y, bs=250, **options):
        calls.append(len(x))
        return original(self, x, y, bs=bs, **options)

    monkeypatch.setattr(AutoAttack, "evaluate", spy)
    options = dict(resolutions=[16], threat_models=[LINF], attack="apgd-ce", n_iter=2, batch_size=4)
    quick, _ = run_sweep(tmp_path, tree, cnn_checkpoints[0], max_images=4, **options)
    full, _ = run_sweep(tmp_path, tree, cnn_checkpoints[0], **options)
    assert calls == [4, 4, 4]  # the first 4 images once, then only the other 8
    again, _ = run_sweep(tmp_path, tree, cnn_checkpoints[0], max_images=4, **options)
    assert calls == [4, 4, 4] and again["resolutions"]["16"]["num_images"] == 4
    assert again["resolutions"]["16"]["threat_models"] == quick["resolutions"]["16"]["threat_models"]
    assert full["resolutions"]["16"]["threat_models"]["Linf-4_255"]["num_points"] == 12


def test_settings_are_checked():
    with pytest.raises(UserError, match="attack"):
        ResolutionSweep(attack="pgd")
    with pytest.raises(UserError, match="distinct positive"):
        ResolutionSweep(resolutions=[224, 224])
    with pytest.raises(UserError, match="threat_models is empty"):
        ResolutionSweep(threat_models=[])
    assert ResolutionSweep(threat_models=[], attack=None).threat_models == []


def test_max_images_are_split_over_ranks_without_overlap():
    class FakeTrainer:
        def __init__(self, rank, world):
            self.global_rank, self.world_size = rank, world

    sweep = ResolutionSweep(max_images=13)
    assert [sweep._share(FakeTrainer(rank, 2)) for rank in range(2)] == [7, 6]
    assert [sweep._share(FakeTrainer(rank, 4)) for rank in range(4)] == [4, 3, 3, 3]
    assert ResolutionSweep()._share(FakeTrainer(0, 2)) is None  # all images
