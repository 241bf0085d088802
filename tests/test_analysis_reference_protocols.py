"""The analyses against the reference scripts they follow: Chen et al.'s feature-variance script
(github.com/Lauch1ng/LKRobust, feature_map_variance/main.py: its list of hidden states, its batches, bilinear resize
of the first 1280 images of the folder) and the resize filter of Bhojanapalli et al.'s protocol, which the paper
leaves open and results.json says so.

Each check can fail: the tapped modules are compared one by one with the script's list, the variances with the
script's computation redone here, the resized images with torchvision's transforms as the scripts call them.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
import torchvision.transforms as V1
import yaml
from PIL import Image

from helpers import REPO, tiny, tiny_vit
from robust_lightning.analysis.blocks import find_blocks
from robust_lightning.analysis.core import Analysis, eval_preprocessing
from robust_lightning.analysis.occlusion import Occlusion
from robust_lightning.analysis.representation import FeatureVariance
from robust_lightning.data.transforms import eval_transform
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import Evaluation
from robust_lightning.models.classifier import RobustClassifier

TRAINER = SimpleNamespace(is_global_zero=True, world_size=1, global_rank=0, ckpt_path=None)
PL_MODULE = SimpleNamespace(hparams={}, device=torch.device("cpu"))


def offline(analysis, net, images):
    labels = torch.zeros(len(images), dtype=torch.long)
    model = RobustClassifier(net).eval()
    analysis.model = lambda pl_module: model
    analysis.images = lambda trainer, pl_module: (images, labels)
    analysis.batches = lambda trainer, pl_module: iter([(images, labels)])


def script_list(net) -> list[torch.nn.Module]:
    """Chen et al.'s list of RepLKNet's hidden states (feature_map_variance/main.py, name == 'replknet')."""
    blocks = [*net.stem]
    for i, stage in enumerate(net.stages):
        blocks += [*stage.blocks]
        if i < len(net.transitions):
            blocks += [*net.transitions[i]]
    return blocks


# ----------------------------------------------------------------------------------- Chen et al.'s list
def test_chens_points_on_replknet_31b_are_the_scripts_57():
    net = timm.create_model("replknet_31b", channels=(4, 8, 8, 8))  # 31B's stages and layers, narrow: quick to build
    bmap = find_blocks(net)
    analysis = FeatureVariance(protocol="chen", points="chen")
    tap = analysis.tap(net, bmap)
    tapped = [module for _, _, module, _ in tap._plan]
    expected = script_list(net)[:-1]  # drop_last_feature: the script drops its list's last entry
    assert len(expected) == 57 and analysis.drops_last(bmap)
    assert len(tapped) - 1 == 57 and all(a is b for a, b in zip(tapped, expected))
    labels = [label for label, _ in tap.points]
    assert labels[:5] == ["stem.0", "stem.1", "stem.2", "stem.3", "stages.0.blocks.0+1.large_kernel"]
    assert labels[8:10] == ["transitions.0.0", "transitions.0.1"]
    # points "blocks": the stem, then each block pair (each RepLK block and ConvFFN with sublayers)
    assert len(FeatureVariance(protocol="chen", sublayers=False).tap(net, bmap).points) == 1 + 24
    assert len(FeatureVariance(protocol="chen").tap(net, bmap).points) == 1 + 48


def script_variances(net, images: torch.Tensor, sweeps: int, batch_size: int) -> list[float]:
    """Chen et al.'s feature_map_variance/main.py, redone: seed 0, `sweeps` permutations of the images, batches
    of `batch_size`, each block's output averaged over the batch's images, only the last batch of a sweep kept,
    the last entry dropped, then latent.var(dim=[-1, -2]).mean(dim=[0, 1])."""
    blocks = script_list(net)
    with torch.random.fork_rng():
        torch.random.manual_seed(0)
        perms = [torch.randperm(len(images)) for _ in range(sweeps)]
    latents = []
    with torch.no_grad():
        for perm in perms:
            for start in range(0, len(images), batch_size):
                xs = images[perm[start : start + batch_size]]
                item = []
                for block in blocks:
                    xs = block(xs)
                    item.append(torch.mean(xs, dim=0))
            latents.append(item)
    per_layer = [torch.stack([latents[s][i] for s in range(sweeps)]) for i in range(len(blocks))][:-1]
    return [float(latent.var(dim=[-1, -2]).mean(dim=[0, 1])) for latent in per_layer]


def test_chens_protocol_reproduces_the_scripts_variances_on_a_tiny_replknet():
    net = tiny("replknet_test")
    images = torch.rand(10, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    analysis = FeatureVariance(protocol="chen", points="chen", sweeps=3, batch_size=4, max_images=10, plot=False)
    offline(analysis, net, images)
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
    expected = script_variances(net, images, sweeps=3, batch_size=4)
    assert len(section["points"]) == len(expected) == 4 + 8 + 6 - 1
    assert [p["variance"] for p in section["points"]] == pytest.approx(expected, rel=1e-5)
    assert section["protocol"]["differences"] == [] and section["conditions"]["sweeps"] == 3
    # every batch in order instead of the script's batches: another number, and results.json says so
    analysis = FeatureVariance(protocol="chen", points="chen", batch_size=4, max_images=10, plot=False)
    offline(analysis, net, images)
    analysis.batches = lambda trainer, pl_module: iter([(images[i : i + 4], None) for i in range(0, 10, 4)])
    section, _, _ = analysis.analyse(TRAINER, PL_MODULE)
    assert [p["variance"] for p in section["points"]] != pytest.approx(expected, rel=1e-3)
    assert any("sweeps: 10" in d for d in section["protocol"]["differences"])


def test_chens_points_on_vit_and_resnet_and_refused_elsewhere():
    vit = tiny_vit()  # the script: patch embedding, then the residual stream after each attention and MLP
    analysis = FeatureVariance(protocol="chen", points="chen")
    assert [kind for _, kind in analysis.tap(vit, find_blocks(vit)).points] == ["stem"] + ["attention", "mlp"] * 3
    resnet = tiny("test_resnet")  # the script: the stem (conv1, bn1, act1, maxpool), then each block
    bmap = find_blocks(resnet)
    assert len(analysis.tap(resnet, bmap).points) == 1 + len(bmap.units) and not analysis.drops_last(bmap)
    convnext = SimpleNamespace(model=SimpleNamespace(net=tiny("test_convnext")))
    with pytest.raises(UserError, match="does not apply"):
        analysis.check(TRAINER, convnext)
    analysis.check(TRAINER, SimpleNamespace(model=SimpleNamespace(net=resnet)))
    with pytest.raises(UserError, match="protocol chen"):
        FeatureVariance(protocol="parkkim", sweeps=10)


# --------------------------------------------------------------------------------------- resize filter
def photo(width: int = 45, height: int = 30) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_the_bilinear_option_is_chens_resize_and_bicubic_the_data_modules():
    image = photo()
    chen = V1.Compose([V1.Resize(16), V1.CenterCrop(14), V1.PILToTensor()])  # the script's Resize(256), crop 224
    bilinear = eval_preprocessing(14, 14 / 16, "shorter_side", "bilinear")(image)
    assert torch.equal(bilinear, chen(image))
    bicubic = eval_preprocessing(14, 14 / 16, "shorter_side", "bicubic")(image)
    assert torch.equal(bicubic, eval_transform(14, 14 / 16)(image)) and not torch.equal(bicubic, bilinear)
    whole = eval_preprocessing(14, 0.875, "whole", "bicubic")(image)
    assert torch.equal(whole, eval_transform(14, 0.875, "whole")(image))
    with pytest.raises(UserError, match="interpolation"):
        Occlusion(interpolation="nearest")


class FolderData:
    """A data module (EvaluationData) of which an analysis reads the images alone: they go through the transform it
    is given. The other methods of the contract are there, and fail if called."""

    image_size, crop_pct, num_workers = 14, 14 / 16, 0

    def __init__(self, images, eval_resize="shorter_side"):
        self.images, self.eval_resize, self.transforms = images, eval_resize, []

    def eval_dataloader_with(self, transform, batch_size=None, num_workers=None):
        self.transforms.append(transform)
        transform = transform or eval_transform(self.image_size, self.crop_pct, self.eval_resize)
        images = torch.stack([transform(image) for image in self.images])
        return [{"image": images, "label": torch.zeros(len(images), dtype=torch.long), "key": ["a"] * len(images)}]

    def evaluation_source(self):
        raise AssertionError("not read by the analysis")

    expected_eval_images = training_sample = conditions = evaluation_source


@pytest.mark.parametrize("interpolation", [None, "bilinear"])
def test_an_analysis_reads_its_images_through_its_filter(interpolation):
    data = FolderData([photo(), photo(30, 40)])
    trainer = SimpleNamespace(**vars(TRAINER), datamodule=data)
    analysis = FeatureVariance(max_images=2, interpolation=interpolation)
    images, _ = Analysis.images(analysis, trainer, PL_MODULE)
    reference = V1.Compose([V1.Resize(16), V1.CenterCrop(14), V1.PILToTensor()])  # torchvision: bilinear
    expected = torch.stack([reference(image) for image in data.images]).float() / 255
    assert (data.transforms[0] is None) == (interpolation is None)
    assert torch.equal(images, expected) == (interpolation == "bilinear")
    assert analysis.preprocessed == f"resize 16 {interpolation or 'bicubic'}, center crop 14"


# -------------------------------------------------------------------------------- what results.json says
@pytest.mark.parametrize("eval_resize", ["whole", "shorter_side"])
def test_results_name_the_resize_and_bhojanapallis_open_filter(monkeypatch, eval_resize):
    published = []
    monkeypatch.setattr(Evaluation, "publish", lambda self, trainer, section, *args: published.append(section))
    trainer = SimpleNamespace(**vars(TRAINER), datamodule=FolderData([photo()], eval_resize))
    analysis = FeatureVariance(max_images=1)
    list(Analysis.batches(analysis, trainer, PL_MODULE))
    protocol = {"follows": "paper", "differences": ["another"]}
    analysis.publish(trainer, {"protocol": protocol, "conditions": {}}, {})
    analysis.publish(trainer, {"conditions": {}}, {})
    with_protocol, without = published
    assert protocol["differences"] == ["another"]  # the analysis's own list is not changed in place
    described = "resize 14x14 bicubic (whole image" if eval_resize == "whole" else "resize 16 bicubic"
    assert with_protocol["conditions"]["eval_preprocessing"].startswith(described)
    if eval_resize == "whole":
        assert with_protocol["protocol"]["differences"][0] == "another"
        assert "do not name the filter" in with_protocol["protocol"]["differences"][1]
        assert "do not name the filter" in without["protocol"]["differences"][0]
    else:
        assert with_protocol["protocol"] == protocol and "protocol" not in without


# ------------------------------------------------------------------------ the first images of the folder
def test_the_first_images_of_a_folder_are_the_scripts_subset(tmp_path):
    """The script reads Subset(ImageFolder(val), first 1280 indices): sorted class folders, then sorted files.
    data.eval_limit N without data.eval_subset reads the same N images, in the same order."""
    from robust_lightning.data.datamodule import ImageNetDataModule
    from robust_lightning.data.sources import FolderSource

    values = {}
    for c, wnid in enumerate(["n01443537", "n01440764"]):  # created out of order: the reading sorts them
        for i, name in enumerate(["b.png", "a.png", "c.png"]):
            (tmp_path / "val" / wnid).mkdir(parents=True, exist_ok=True)
            values[f"{wnid}/{name}"] = 20 * (3 * c + i) + 10
            image = np.full((20, 24, 3), values[f"{wnid}/{name}"], np.uint8)
            Image.fromarray(image).save(tmp_path / "val" / wnid / name)
    data = ImageNetDataModule(
        source=FolderSource(root=str(tmp_path)), image_size=8, eval_limit=4, num_workers=0, eval_batch_size=3
    )
    data.setup("test")
    trainer = SimpleNamespace(**vars(TRAINER), datamodule=data)
    analysis = FeatureVariance(max_images=4, batch_size=3, interpolation="bilinear")
    images, _ = Analysis.images(analysis, trainer, PL_MODULE)
    first = sorted(values)[:4]  # ImageFolder's order
    assert first == ["n01440764/a.png", "n01440764/b.png", "n01440764/c.png", "n01443537/a.png"]
    assert images[:, 0, 0, 0].mul(255).round().tolist() == [values[name] for name in first]


# ------------------------------------------------------------------------------------------ the configs
def shipped_callback(name: str) -> dict:
    config = yaml.safe_load((REPO / "configs" / "analysis" / f"{name}.yaml").read_text())
    return config["trainer"]["callbacks"][0]["init_args"]


def test_chens_configs_default_to_the_scripts_protocol_and_bhojanapallis_to_384_px():
    variance = shipped_callback("feature_variance_chen")
    assert (variance["protocol"], variance["points"], variance["sweeps"]) == ("chen", "chen", 10)
    assert variance["interpolation"] == "bilinear" and shipped_callback("occlusion_chen_fig4")["interpolation"]
    for name in ("fgsm_sweep_chen", "pgd_sweep_chen", "lesion_chen_replknet"):  # their scripts resize bicubically
        assert shipped_callback(name).get("interpolation") is None
    for path in (REPO / "configs" / "analysis").glob("*.yaml"):
        text = path.read_text()
        if text.startswith("# Bhojanapalli"):  # their real models take 384 px (App. A)
            assert "--data.image_size 224" not in text and "--data.image_size 384" in text, path.name
