"""The seed papers' attack analyses and the weight / shape-bias analyses: the spatial grid attack, FGSM / PGD
sweeps, the transfer matrix, kernel attention distance and shape bias, plus one shipped config end to end."""

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from PIL import Image
from torch import nn

from helpers import REPO
from robust_lightning.analysis.attack_sweeps import AttackSweep, TransferMatrix, attack_batch
from robust_lightning.analysis.kernels import KernelAttentionDistance, depthwise_convs, kernel_distance, stage_of
from robust_lightning.analysis.shape_bias import (
    ShapeBias,
    category_probabilities,
    cue_conflict_images,
    decisions,
    load_mapping,
    shape_bias_table,
)
from robust_lightning.attacks.spatial import spatial_grid, spatial_grid_attack, transform_images
from robust_lightning.cli import main
from robust_lightning.errors import UserError
from robust_lightning.training.lightning_module import ImageClassifier


def tiny_cnn(seed: int, classes: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, classes)
    ).eval()


# ------------------------------------------------------------------------------------------------ spatial
def test_the_default_grid_is_the_papers_2511_transforms():
    grid = spatial_grid()
    assert grid.shape == (2511, 3)
    assert torch.unique(grid[:, 0]).tolist() == [-16, -12, -8, -4, 0, 4, 8, 12, 16]
    assert torch.unique(grid[:, 1]).tolist() == torch.unique(grid[:, 0]).tolist()
    assert torch.unique(grid[:, 2]).tolist() == list(range(-30, 31, 2))
    assert int((grid == 0).all(1).sum()) == 1  # the identity, once
    assert spatial_grid(1, 16, 1, 30).tolist() == [[0.0, 0.0, 0.0]]


def test_the_identity_transform_reproduces_clean_accuracy_exactly():
    model = tiny_cnn(0)
    x, y = torch.rand(10, 3, 16, 16), torch.arange(10) % 3
    result = spatial_grid_attack(model, x, y, translations=1, rotations=1)
    clean = model(x).argmax(1) == y
    assert torch.equal(result.correct[:, 0], clean) and torch.equal(result.robust, clean)
    assert torch.equal(result.clean_correct, clean)


def test_the_grid_moves_content_as_stated_and_an_inverse_shift_recovers_it():
    x = torch.zeros(1, 3, 16, 16)
    x[0, :, 5, 6] = 1.0
    moved = transform_images(x, torch.tensor([[3.0, -2.0, 0.0]], dtype=torch.float64))
    assert moved[0, 0].nonzero().tolist() == [[3, 9]]  # right by 3, up by 2
    # a random image shifted and shifted back: equal wherever the content never left the frame
    image = torch.rand(1, 3, 16, 16)
    there = transform_images(image, torch.tensor([[4.0, 4.0, 0.0]], dtype=torch.float64))
    back = transform_images(there, torch.tensor([[-4.0, -4.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(back[..., :12, :12], image[..., :12, :12], atol=1e-5)
    assert back[..., 12:, :].abs().max() == 0 and back[..., :, 12:].abs().max() == 0  # zero fill
    # rotation about the centre, counter-clockwise on screen: 90 degrees is rot90
    turned = transform_images(image, torch.tensor([[0.0, 0.0, 90.0]], dtype=torch.float64))
    assert torch.allclose(turned, torch.rot90(image, 1, (2, 3)), atol=1e-5)


def test_an_invariant_model_stays_robust_and_a_fragile_one_does_not():
    # a bright 4x4 block in the centre stays in the frame under every shift and rotation of the grid
    x = torch.zeros(2, 3, 64, 64)
    x[:, :, 30:34, 30:34] = 1.0
    y = torch.ones(2, dtype=torch.long)

    def peak(z):  # class 1 iff some pixel is bright
        m = z.amax((1, 2, 3))
        return torch.stack([0.5 - m, m - 0.5], 1)

    result = spatial_grid_attack(peak, x, y, batch_size=300)  # batches cut across images
    assert result.robust.all() and result.correct.shape == (2, 2511)

    def brightness(z):  # class 1 iff the image is entirely white: any zero fill breaks it
        m = z.mean((1, 2, 3))
        return torch.stack([0.999 - m, m - 0.999], 1)

    white = torch.ones(2, 3, 64, 64)
    result = spatial_grid_attack(brightness, white, y, batch_size=1000)
    assert result.clean_correct.all() and not result.robust.any()
    assert int(result.correct.sum()) == 2  # only the identity
    worst = result.worst_transform
    assert (worst[:, :2].abs() == 16).all()  # the most zero fill: the largest shift on both axes
    assert torch.equal(spatial_grid_attack(brightness, white, y, batch_size=7).margins, result.margins)


# ------------------------------------------------------------------------------------------------ sweeps
def stubbed(analysis, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The analysis on given images and model, without a Trainer (a stand-in with what it reads of one)."""
    analysis.images = lambda trainer, pl_module: (x, y)
    analysis.model = lambda pl_module: model
    return analysis.analyse(SimpleNamespace(is_global_zero=True), SimpleNamespace(hparams={"arch": "tiny_cnn"}))


def test_fgsm_at_eps_0_is_clean_accuracy_and_accuracy_falls_with_eps():
    # binary linear model: FGSM moves every pixel against the margin, so accuracy cannot rise with eps
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 2)).eval()
    x = torch.rand(64, 3, 8, 8)
    y = model(x).argmax(1)  # all correct at first
    y[:8] = 1 - y[:8]
    eps = [0.0, 0.002, 0.005, 0.01, 0.02, 0.05]
    section, metrics, figure = stubbed(
        AttackSweep(attacks=["fgsm", "pgd"], eps=eps, steps=[3], batch_size=16, plot=False), model, x, y
    )
    assert figure is None
    fgsm_acc = section["curves"]["fgsm"]["accuracy"]
    assert fgsm_acc[0] == section["clean_accuracy"] == pytest.approx(56 / 64)
    assert all(a >= b for a, b in itertools.pairwise(fgsm_acc)) and fgsm_acc[-1] < fgsm_acc[0]
    assert section["curves"]["pgd-3"]["accuracy"][0] == section["clean_accuracy"]
    assert metrics["fgsm/eps_0.05"] == fgsm_acc[-1]
    for attack in ("fgsm", "pgd"):  # perturbations stay in the eps-ball and in [0, 1]
        x_adv = attack_batch(model, x, y, attack, 0.03, steps=5, relative_step=0.5, random_start=True)
        assert (x_adv - x).abs().max() <= 0.03 + 1e-6 and x_adv.min() >= 0 and x_adv.max() <= 1


def test_a_step_sweep_draws_both_panels(tmp_path):
    model, x, y = tiny_cnn(1), torch.rand(8, 3, 8, 8), torch.arange(8) % 3
    section, _, figure = stubbed(
        AttackSweep(attacks=["pgd"], eps=[0, 0.01], steps=[1, 2], relative_step=0.25, random_start=True), model, x, y
    )
    assert set(section["curves"]) == {"pgd-1", "pgd-2"} and len(figure.axes) == 2
    figure.savefig(tmp_path / "sweep.png")
    with pytest.raises(UserError, match="unknown attack 'cw'"):
        AttackSweep(attacks=["cw"])


def test_the_transfer_matrix_diagonal_is_the_white_box_attack():
    models = [tiny_cnn(seed) for seed in (0, 1, 2)]
    x, y = torch.rand(12, 3, 8, 8), torch.arange(12) % 3
    settings = dict(attack="pgd", eps=0.05, steps=3, relative_step=0.5, random_start=True, seed=3, batch_size=5)
    matrix = TransferMatrix(checkpoints=["a.ckpt", "b.ckpt"], **settings)
    clean, accuracy = matrix.matrix(models, x, y)
    for i, model in enumerate(models):
        sweep = AttackSweep(
            attacks=["pgd"],
            eps=[settings["eps"]],
            steps=[settings["steps"]],
            plot=False,
            **{k: settings[k] for k in ("relative_step", "random_start", "seed", "batch_size")},
        )
        section, _, _ = stubbed(sweep, model, x, y)
        assert accuracy[i][i] == section["curves"]["pgd-3"]["accuracy"][0]
        assert clean[i] == section["clean_accuracy"]
    assert all(0 <= a <= 1 for row in accuracy for a in row)
    with pytest.raises(UserError, match="at least two models"):
        TransferMatrix(checkpoints=[], include_tested_model=True)


# ------------------------------------------------------------------------------------------------ kernels
def test_kernel_distance_of_delta_and_uniform_kernels():
    centre, corner, uniform = torch.zeros(1, 1, 7, 7), torch.zeros(1, 1, 7, 7), torch.ones(1, 1, 3, 3)
    centre[0, 0, 3, 3] = 2.5
    corner[0, 0, 0, 6] = -1.0  # |W|: the sign does not matter
    assert kernel_distance(centre, normalize=True).item() == 0.0
    assert kernel_distance(corner, normalize=True).item() == pytest.approx(1.0)
    # 3x3: centre at 0, 4 edge taps at 1, 4 corners at sqrt 2; over R sqrt 2 = sqrt 2 and over 9 taps
    expected = (4 * 1 + 4 * math.sqrt(2)) / math.sqrt(2)
    assert kernel_distance(uniform, normalize=True).item() == pytest.approx(expected / 9)
    assert kernel_distance(uniform).item() == pytest.approx(expected)  # the default: the reference's raw sum
    assert kernel_distance(3 * uniform, normalize=True).item() == pytest.approx(expected / 9)  # scale-free
    assert math.isnan(kernel_distance(torch.zeros(1, 1, 5, 5), normalize=True).item())


def test_kernel_distance_is_chens_formula():
    """One 13 x 13 kernel against the computation of Chen et al.'s kernel_atten_dis.py, written out: per tap
    |W| times its distance to the centre over R sqrt 2, summed per channel."""
    weight = torch.randn(3, 1, 13, 13, generator=torch.Generator().manual_seed(0))
    a = weight.squeeze(1).numpy()
    radius = 6
    expected = []
    for channel in a:
        total = 0.0
        for j in range(13):
            for k in range(13):
                total += abs(channel[j, k]) * math.sqrt((j - radius) ** 2 + (k - radius) ** 2) / (radius * math.sqrt(2))
        expected.append(total)
    assert kernel_distance(weight).tolist() == pytest.approx(expected, rel=1e-5)
    assert 10 < expected[0] < 100  # the raw sum is not the weighted mean (below 1)


def test_replknets_parallel_small_kernels_are_left_out_unless_asked():
    replknet = ImageClassifier(arch="replknet_test", num_classes=4)  # large kernels 7/7/5/5, parallel 3x3
    large = {name for name, _ in KernelAttentionDistance(min_kernel_size=3).layers(replknet)}
    both = {name for name, _ in KernelAttentionDistance(min_kernel_size=3, small_kernels=True).layers(replknet)}
    assert sum(name.endswith("lkb_origin.conv") for name in large) == 4
    assert not any("small_conv" in name for name in large)
    assert len(both - large) == 4 and all(name.endswith("small_conv.conv") for name in both - large)


def test_kernel_distance_finds_depthwise_large_kernels_by_shape():
    convnext = ImageClassifier(arch="test_convnext", num_classes=4)
    layers = depthwise_convs(convnext.model.net, 7)
    assert layers and all(name.endswith("conv_dw") for name, _ in layers)
    assert stage_of("stages.2.blocks.5.conv_dw") == "stages.2" and stage_of("head") == "all"
    first = layers[0][1]
    with torch.no_grad():
        first.weight.zero_()
        first.weight[:, :, 3, 3] = 1.0  # centred deltas
    section, metrics, _ = KernelAttentionDistance(plot=False, normalize=True).analyse(None, convnext)
    assert section["layers"][0]["mean"] == 0.0 and section["layers"][0]["kernel_size"] == [7, 7]
    assert set(section["stages"]) == {stage_of(name) for name, _ in layers}
    assert 0 < metrics["mean"] < 1
    with pytest.raises(UserError, match="does not apply to test_resnet: .*no depthwise convolutions"):
        KernelAttentionDistance().layers(ImageClassifier(arch="test_resnet", num_classes=4))


# ------------------------------------------------------------------------------------------------ shape bias
def cue_conflict_tree(root: Path, stimuli: list[tuple[str, str]], categories: list[str]) -> Path:
    """ROOT/<shape>/<shape>1-<texture><i>.png, a uniform image whose red channel encodes the shape category
    and green the texture (so a fake model can "see" either cue)."""
    for i, (shape, texture) in enumerate(stimuli):
        colour = ((categories.index(shape) + 1) * 10, (categories.index(texture) + 1) * 10, 0)
        (root / shape).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), colour).save(root / shape / f"{shape}1-{texture}{i}.png")
    return root


class CueReader(nn.Module):
    """A fake ImageNet model whose logits favour the category encoded in one colour channel."""

    def __init__(self, mapping: dict[str, list[int]], channel: int):
        super().__init__()
        self.first = [indices[0] for indices in mapping.values()]
        self.channel = channel

    def forward(self, x):
        category = (x[:, self.channel].mean((1, 2)) * 255 / 10).round().long() - 1
        logits = torch.zeros(len(x), 1000)
        logits[torch.arange(len(x)), torch.tensor(self.first)[category]] = 20.0
        return logits


def test_shape_bias_is_1_for_a_shape_reader_and_0_for_a_texture_reader(tmp_path):
    mapping = load_mapping()
    categories = list(mapping)
    assert len(categories) == 16
    stimuli = [("cat", "elephant"), ("dog", "clock"), ("airplane", "bear"), ("truck", "knife"), ("cat", "cat")]
    root = cue_conflict_tree(tmp_path / "cue-conflict", stimuli, categories)
    found = cue_conflict_images(root, categories)
    assert len(found) == 5 and {(s, t) for _, s, t in found} == set(stimuli)
    files = [f for f, _, _ in found]
    for channel, expected in ((0, 1.0), (1, 0.0)):
        decided = decisions(CueReader(mapping, channel), files, mapping, image_size=8, batch_size=2)
        table = shape_bias_table(found, decided, categories)
        assert table["shape_bias"] == expected
        assert table["num_conflict_images"] == 4 and table["excluded_same_category"] == 1  # cat1-cat4 left out
        assert table["per_category"]["cat"]["images"] == 1
        # Bhojanapalli et al.'s shape accuracy counts all 5 stimuli: cat1-cat is decided "cat" by both readers
        assert table["shape_accuracy"] == {0: 5 / 5, 1: 1 / 5}[channel]
    assert table["texture_decisions"] == 4 and table["other_decisions"] == 0


def test_the_16_class_decision_averages_probabilities_within_a_category():
    mapping = load_mapping()
    probs = torch.full((1, 1000), 1e-6)
    probs[0, mapping["dog"]] = 0.5 / len(mapping["dog"])  # half the mass, spread over 100+ dog classes
    probs[0, mapping["airplane"][0]] = 0.1  # airplane has one class
    decided = category_probabilities(probs.log(), mapping).argmax(1).item()
    assert list(mapping)[decided] == "airplane"  # the mean decides, not the sum


def test_a_wrong_cue_conflict_folder_or_model_is_named(tmp_path):
    categories = list(load_mapping())
    with pytest.raises(UserError, match="does not exist; expected ROOT/<shape category>/<shape><n>-<texture><m>.png"):
        cue_conflict_images(tmp_path / "missing", categories)
    (tmp_path / "imagenet" / "n01440764").mkdir(parents=True)
    with pytest.raises(UserError, match=r"unknown folders \['n01440764'\]"):
        cue_conflict_images(tmp_path / "imagenet", categories)
    (tmp_path / "bad" / "cat").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "bad" / "cat" / "photo.png")
    with pytest.raises(UserError, match="photo.png is not named <shape><n>-<texture><m>.png"):
        cue_conflict_images(tmp_path / "bad", categories)
    with pytest.raises(UserError, match="does not apply to this model: it has 10 classes"):
        ShapeBias(root=str(tmp_path)).on_test_start(None, ImageClassifier(arch="test_resnet", num_classes=10))


# ------------------------------------------------------------------------------------------------ end to end
def tiny_checkpoint(path: Path, arch: str = "test_resnet", seed: int = 0) -> Path:
    """A quickstart-shaped checkpoint (10 classes, 32 px) of a tiny timm model."""
    from lightning import Trainer

    torch.manual_seed(seed)
    module = ImageClassifier(arch=arch, num_classes=10, image_size=32)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synthetic")  # generated by the first run, shared by the others


def shipped(name: str, tmp_path: Path, checkpoint: Path, synthetic: Path, **callback_args) -> tuple[Path, Path]:
    """configs/analysis/<name>.yaml as shipped, on ``checkpoint``, tiny data and ``callback_args``; returns the
    config written to tmp_path and the run directory it will use."""
    config = yaml.safe_load((REPO / "configs" / "analysis" / f"{name}.yaml").read_text())
    config["ckpt_path"] = str(checkpoint)
    config["trainer"] |= {"default_root_dir": str(tmp_path / "runs"), "enable_progress_bar": False}
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    config["trainer"]["callbacks"][0]["init_args"] |= callback_args
    config["data"] |= {"eval_limit": 8, "eval_batch_size": 8, "num_workers": 0}
    config["data"]["source"]["init_args"] |= {"train_per_class": 2, "val_per_class": 1, "root": str(synthetic)}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / "runs" / config["trainer"]["logger"]["init_args"]["name"] / "version_0"


@pytest.mark.parametrize(
    "name,arch,section,args",
    [
        ("attack_sweep_bhojanapalli", "test_resnet", "attack_sweep", {"max_images": 8}),
        ("pgd_sweep_chen", "test_resnet", "pgd_sweep", {"max_images": 8, "steps": [1, 2], "eps": [0.0, 0.004]}),
        ("fgsm_sweep_chen", "test_resnet", "fgsm_sweep", {"max_images": 8, "eps": [0.0, 0.1]}),
        ("feature_variance_chen", "test_resnet", "feature_variance", {"max_images": 8, "batch_size": 4}),
        ("spatial_attack", "test_resnet", "spatial_attack", {"max_images": 4, "translations": 3, "rotations": 3}),
        (
            "hessian_parkkim_fig4",
            "test_resnet",
            "hessian",
            {"max_images": 8, "batch_size": 4, "top_k": 2, "max_iter": 3},
        ),
        ("kernel_distance_chen", "test_convnext", "kernel_distance", {}),
    ],
)
def test_a_shipped_config_runs_end_to_end(tmp_path, synthetic, name, arch, section, args):
    config, run = shipped(name, tmp_path, tiny_checkpoint(tmp_path / "model.ckpt", arch), synthetic, **args)
    assert main(["test", "--config", str(config)]) == 0
    results = json.loads((run / "results.json").read_text())
    assert {section, "test"} <= set(results)
    assert results[section]["conditions"]["checkpoint"] == str(tmp_path / "model.ckpt")
    assert (run / f"{section}.png").is_file()


def test_the_shipped_transfer_matrix_config_end_to_end(tmp_path, synthetic):
    """configs/analysis/transfer_matrix.yaml: the tested checkpoint against another one."""
    robust = tiny_checkpoint(tmp_path / "robust" / "checkpoints" / "last.ckpt", seed=0)
    clean = tiny_checkpoint(tmp_path / "clean" / "checkpoints" / "last.ckpt", seed=1)
    config, run = shipped(
        "transfer_matrix", tmp_path, robust, synthetic, checkpoints=[str(clean)], max_images=8, steps=2
    )
    assert main(["test", "--config", str(config)]) == 0
    section = json.loads((run / "results.json").read_text())["transfer_matrix"]
    assert section["models"] == ["robust", "clean"] and section["num_images"] == 8
    assert set(section["accuracy"]["clean"]) == {"robust", "clean"}
    assert section["white_box"]["clean"] == section["accuracy"]["clean"]["clean"]
    assert (run / "transfer_matrix.png").is_file()
    # a checkpoint that is not there fails before the test loop, naming it
    config, _ = shipped("transfer_matrix", tmp_path, robust, synthetic, checkpoints=[str(tmp_path / "nowhere.ckpt")])
    assert main(["test", "--config", str(config)]) == 2


@pytest.mark.parametrize("name", ["kernel_distance_chen", "shape_bias"])
def test_configs_that_need_another_model_say_so_on_the_quickstart_model(tmp_path, synthetic, name, capsys):
    config, _ = shipped(name, tmp_path, tiny_checkpoint(tmp_path / "model.ckpt"), synthetic)
    assert main(["test", "--config", str(config)]) == 2
    assert "does not apply" in capsys.readouterr().err


def test_sweeps_and_the_transfer_matrix_show_progress_on_rank_zero_only(capsys):
    model, x, y = tiny_cnn(0), torch.rand(6, 3, 8, 8), torch.arange(6) % 3
    sweep = AttackSweep(attacks=["fgsm"], eps=[0.0, 0.01], batch_size=3, plot=False)
    sweep.images, sweep.model = (lambda trainer, pl_module: (x, y)), (lambda pl_module: model)
    hparams = SimpleNamespace(hparams={"arch": "tiny_cnn"})
    for rank_zero in (True, False):
        quiet = sweep.analyse(SimpleNamespace(is_global_zero=rank_zero), hparams)[0]
        assert ("attack sweep" in capsys.readouterr().err) == rank_zero
    matrix = TransferMatrix(checkpoints=["a.ckpt"], attack="fgsm", eps=0.01, batch_size=3)
    for shown in (True, False):
        matrix.matrix([model, tiny_cnn(1)], x, y, progress=shown)
        assert ("transfer matrix" in capsys.readouterr().err) == shown
    assert quiet["curves"]["fgsm"]["accuracy"][0] == quiet["clean_accuracy"]
