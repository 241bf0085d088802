"""Released checkpoints load with no conversion step (robust_lightning.load_model and --model.init_from).

The released models are rebuilt here from the paper's description, independently of robust_lightning's own
ConvStem: Singh et al. 2023 (Sec. 3.2, Fig. 2, App. B) replace ConvNeXt's 4x4 patchify stem by two 3x3 stride-2
convolutions (3 -> 48 -> 96 for ConvNeXt-T), each followed by a channels-first LayerNorm and GELU, and a ViT's
16x16 patchify stem by four such layers (48, 96, 192, 384 channels) and a 1x1 convolution to the width. The
body is timm's, as in the release; the stem sits in a module whose Sequential is called ``stem``, so the keys are
those of the released files (``stem.stem.0.weight``, ``patch_embed.proj.stem.0.weight``). The release trains
``normalize_model(net)`` (keys ``normalize.*``, ``model.*``) inside an attack wrapper (``base_model.``) under DDP
(``module.``). Tiny widths and depths keep every test at a few seconds.
"""

import json
import pickle
import re
from collections import OrderedDict

import numpy as np
import pytest
import timm
import torch
from torch import nn

import robust_lightning
from robust_lightning.errors import UserError
from robust_lightning.models.robustbench import robustbench_entries, robustbench_entry

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TINY_CONVNEXT = dict(depths=(1, 1, 1, 1), dims=(96, 16, 16, 16))  # ConvNeXt-T's stem fixes dims[0] = 96
TINY_VIT = dict(depth=1)


class ChannelsFirstLayerNorm(nn.Module):
    """LayerNorm over the channels of an NCHW map (the normalisation of the ConvStem)."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(channels))
        self.bias = nn.Parameter(0.1 * torch.randn(channels))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        return self.weight[:, None, None] * (x - mean) / torch.sqrt(var + self.eps) + self.bias[:, None, None]


class PaperConvStem(nn.Module):
    """3x3 convs of the given strides, each + LayerNorm + GELU; optionally a final 1x1 conv (ViT)."""

    def __init__(self, channels, strides, out_dim=None):
        super().__init__()
        layers, prev = [], 3
        for ch, stride in zip(channels, strides):
            layers += [nn.Conv2d(prev, ch, 3, stride, 1), ChannelsFirstLayerNorm(ch), nn.GELU()]
            prev = ch
        if out_dim is not None:
            layers.append(nn.Conv2d(prev, out_dim, 1))
        self.stem = nn.Sequential(*layers)

    def forward(self, x):
        return self.stem(x)


class ImageNormalizer(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


class AttackWrapper(nn.Module):
    """The release's training wrapper: the model is its ``base_model``."""

    def __init__(self, base_model):
        super().__init__()
        self.base_model = base_model

    def forward(self, x):
        return self.base_model(x)


def released_convnext_t(seed: int, num_classes: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    net = timm.create_model("convnext_tiny", num_classes=num_classes, **TINY_CONVNEXT)
    net.stem = PaperConvStem((48, 96), (2, 2))
    return net


def released_vit_s(seed: int, num_classes: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    net = timm.create_model("vit_small_patch16_224", num_classes=num_classes, img_size=32, **TINY_VIT)
    net.patch_embed.proj = PaperConvStem((48, 96, 192, 384), (2, 2, 2, 2), out_dim=384)
    return net


def normalize_model(net, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> nn.Sequential:
    return nn.Sequential(OrderedDict(normalize=ImageNormalizer(mean, std), model=net))


def images(size=32, n=3):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(7))


def assert_same_logits(ours, reference, x):
    assert not ours.training
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), rtol=1e-4, atol=1e-4)


def test_official_weights_and_ema_files(tmp_path):
    raw = normalize_model(released_convnext_t(0))
    ema = normalize_model(released_convnext_t(1))
    weights = tmp_path / "weights_20.pt"
    torch.save({f"module.{k}": v for k, v in AttackWrapper(raw).state_dict().items()}, weights)  # DDP model
    assert "module.base_model.model.stem.stem.0.weight" in torch.load(weights)
    weights_ema = tmp_path / "weights_ema_20.pt"
    torch.save(AttackWrapper(ema).state_dict(), weights_ema)  # timm get_state_dict(model_ema): no module.

    for path, reference in ((weights, raw), (weights_ema, ema)):
        for arch in ("convnext_tiny_convstem", "robustbench:Singh2023Revisiting_ConvNeXt-T-ConvStem"):
            model = robust_lightning.load_model(arch, path, arch_kwargs=TINY_CONVNEXT)
            # the file's normaliser (ImageNet) is inside the model, so it takes [0, 1] images like the reference
            torch.testing.assert_close(model.normalize.mean.flatten(), torch.tensor(IMAGENET_MEAN))
            assert model.net.num_classes == 10  # from the checkpoint's head
            assert_same_logits(model, reference, images())


def test_official_weights_without_normaliser_layer(tmp_path):
    # model.add_normalization 0: the net takes [0, 1] input, no normalize.* keys
    net = released_convnext_t(2)
    path = tmp_path / "weights_3.pt"
    torch.save({f"module.{k}": v for k, v in AttackWrapper(net).state_dict().items()}, path)
    model = robust_lightning.load_model("convnext_tiny_convstem", path, arch_kwargs=TINY_CONVNEXT)
    assert isinstance(model.normalize, nn.Identity)
    assert_same_logits(model, net, images())


def test_official_full_model_file_is_read_without_unpickling_code(tmp_path):
    raw = normalize_model(released_convnext_t(0))
    ema = normalize_model(released_convnext_t(1))
    wrapped = AttackWrapper(raw)
    optimizer = torch.optim.AdamW(wrapped.parameters(), betas=(0.9, 0.95))
    for group in optimizer.param_groups:
        group["lr"] = np.interp([0.5], [0, 1], [0, 1e-3])[0]  # the release sets numpy float64 learning rates
    path = tmp_path / "full_model_20.pth"
    torch.save(
        {
            "model_state_dict": {f"module.{k}": v for k, v in wrapped.state_dict().items()},
            "optimizer_state_dict": optimizer.state_dict(),
            "loss_scaler_state_dict": torch.amp.GradScaler("cpu").state_dict(),
            "epoch": 20,
            "state_dict_ema": AttackWrapper(ema).state_dict(),
        },
        path,
    )
    with pytest.raises(pickle.UnpicklingError):  # plain weights_only loading refuses the numpy scalars
        torch.load(path, weights_only=True)
    model = robust_lightning.load_model("convnext_tiny_convstem", path, arch_kwargs=TINY_CONVNEXT)
    assert_same_logits(model, raw, images())
    model = robust_lightning.load_model("convnext_tiny_convstem", path, arch_kwargs=TINY_CONVNEXT, prefer_ema=True)
    assert_same_logits(model, ema, images())


def test_pickled_full_model_is_refused(tmp_path):
    path = tmp_path / "full_model_5.pth"
    torch.save(normalize_model(released_convnext_t(0)), path)  # a whole module: unpickling it runs code
    with pytest.raises(UserError) as info:
        robust_lightning.load_model("convnext_tiny_convstem", path, arch_kwargs=TINY_CONVNEXT)
    message = str(info.value)
    assert f"refusing to load {path}" in message and "weights_only=True" in message
    assert "torch.load(PATH, weights_only=False)" in message and "state_dict()" in message  # how to get them out


def test_robustbench_files(tmp_path):
    # ConvNeXt-T: RobustBench's model is the bare net (no normaliser); a file that stores one brings it along
    net = released_convnext_t(3)
    bare = tmp_path / "Singh2023Revisiting_ConvNeXt-T-ConvStem.pt"
    torch.save(net.state_dict(), bare)
    model = robust_lightning.load_model(
        "robustbench:Singh2023Revisiting_ConvNeXt-T-ConvStem", bare, arch_kwargs=TINY_CONVNEXT
    )
    assert isinstance(model.normalize, nn.Identity)
    assert_same_logits(model, net, images())

    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    normalized = normalize_model(net, mean, std)
    stored = tmp_path / "with_normalizer.pt"
    torch.save({"state_dict": {k.removeprefix("model."): v for k, v in normalized.state_dict().items()}}, stored)
    assert "normalize.mean" in torch.load(stored)["state_dict"]
    model = robust_lightning.load_model(
        "robustbench:Singh2023Revisiting_ConvNeXt-T-ConvStem", stored, arch_kwargs=TINY_CONVNEXT
    )
    assert_same_logits(model, normalized, images())

    # ViT-S: RobustBench wraps it in normalize_model(..., ImageNet mean/std); the file holds only the net
    vit = released_vit_s(4)
    path = tmp_path / "Singh2023Revisiting_ViT-S-ConvStem.pt"
    torch.save(vit.state_dict(), path)
    assert "patch_embed.proj.stem.0.weight" in torch.load(path)
    model = robust_lightning.load_model(
        "robustbench:Singh2023Revisiting_ViT-S-ConvStem", path, image_size=32, arch_kwargs=TINY_VIT
    )
    assert_same_logits(model, normalize_model(vit), images())


def test_robustbench_entries_resolve():
    entry = robustbench_entry("robustbench:Singh2023Revisiting_ConvNeXt-T-ConvStem")
    assert entry.timm_arch == "convnext_tiny_convstem" and entry.mean is None
    assert (entry.clean_acc, entry.autoattack_acc) == (72.72, 49.46)  # the leaderboard's model_info json
    prep = entry.preprocessing
    assert (prep.resize, prep.crop, prep.interpolation, prep.image_size) == (256, 224, "bicubic", 224)
    wong = robustbench_entry("robustbench:Wong2020Fast").preprocessing
    assert (wong.resize, wong.crop) == (None, 288)
    assert robustbench_entry("Salman2020Do_50_2").mean == IMAGENET_MEAN
    for entry in robustbench_entries().values():
        assert timm.is_model(entry.timm_arch), entry.name
    with pytest.raises(UserError, match="Did you mean: robustbench:Salman2020Do_R50"):
        robustbench_entry("robustbench:Salman2020Do_R5")


def test_robustness_library_layout(tmp_path):
    # MadryLab robustness library (Salman2020Do_*, Engstrom2019Robustness): the AttackerModel's net appears
    # twice (model.*, attacker.model.*), its normaliser as normalizer.new_mean / new_std of shape (3, 1, 1)
    torch.manual_seed(0)
    net = timm.create_model("resnet18", num_classes=10)
    sd = {}
    for k, v in net.state_dict().items():
        sd[f"module.model.{k}"] = v
        sd[f"module.attacker.model.{k}"] = v
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    for prefix in ("module.normalizer.", "module.attacker.normalize."):
        sd[prefix + "new_mean"], sd[prefix + "new_std"] = mean, std
    path = tmp_path / "Salman2020Do_R18.pt"
    torch.save({"model": sd, "epoch": 90}, path)
    model = robust_lightning.load_model("robustbench:Salman2020Do_R18", path)
    assert_same_logits(model, normalize_model(net), images(64))


def test_our_checkpoint_and_exports(tmp_path):
    from lightning import Trainer

    from robust_lightning.training.export import export_timm_folder, export_weights
    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(
        arch="convnext_atto_convstem", num_classes=5, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.4), ema_decay=0.9
    )
    with torch.no_grad():
        for p in module.ema.module.parameters():
            p.mul_(0.5)  # an EMA copy that differs from the raw weights
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)

    for prefer_ema, reference in ((False, module.model), (True, module.ema.module)):
        model = robust_lightning.load_model(None, ckpt, prefer_ema=prefer_ema)
        assert_same_logits(model, reference, images())
        out = export_weights(ckpt, tmp_path / f"export_{prefer_ema}.safetensors", ema=prefer_ema)
        model = robust_lightning.load_model("convnext_atto_convstem", out)  # normaliser from the metadata
        assert_same_logits(model, reference, images())
        # a timm model folder: the architecture, classes and normaliser from its config.json
        folder = export_timm_folder(ckpt, tmp_path / f"folder_{prefer_ema}", ema=prefer_ema)
        model = robust_lightning.load_model(None, folder)
        assert model.net.num_classes == 5 and model.normalize.mean.flatten().tolist() == pytest.approx([0.4, 0.5, 0.6])
        assert_same_logits(model, reference, images())
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match=f"the timm model folder {folder} has no model.safetensors"):
        robust_lightning.load_model(None, folder)


def test_a_folder_written_by_export_is_a_warm_start_on_the_command_line(tmp_path):
    """--model.init_from FOLDER gives the same validation as the checkpoint it was exported from."""
    from lightning import Trainer

    from helpers import tiny_config
    from robust_lightning.cli import main
    from robust_lightning.training.export import export_timm_folder
    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(arch="convnext_atto_convstem", num_classes=4, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.4))
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    folder = export_timm_folder(tmp_path / "trained.ckpt", tmp_path / "exported")
    metrics = {}
    for name, source in (("ckpt", tmp_path / "trained.ckpt"), ("folder", folder)):
        (tmp_path / name).mkdir()
        config = tiny_config(tmp_path / name, **{"model.init_from": str(source)})
        assert main(["validate", "--config", str(config)]) == 0
        [results] = (tmp_path / name / "runs").glob("tiny/version_*/results.json")
        metrics[name] = json.loads(results.read_text())["validate"]["metrics"]
    assert metrics["folder"]["val/loss"] == pytest.approx(metrics["ckpt"]["val/loss"], rel=1e-6)


def test_every_file_kind_load_model_reads_is_a_command_line_warm_start(tmp_path):
    """validate --model.init_from FILE gives load_model's model for each kind of file: the same loss for all."""
    from lightning import Trainer

    from helpers import tiny_config
    from robust_lightning.cli import main
    from robust_lightning.training.export import export_timm_folder, export_weights
    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(arch="convnext_atto_convstem", num_classes=4, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    files = {"lightning": tmp_path / "trained.ckpt"}
    trainer.save_checkpoint(files["lightning"])
    net = {k.removeprefix("net."): v for k, v in module.model.state_dict().items() if k.startswith("net.")}
    normaliser = {k: v for k, v in module.model.state_dict().items() if k.startswith("normalize.")}
    files["safetensors_export"] = export_weights(files["lightning"], tmp_path / "export.safetensors")
    files["pt_export"] = export_weights(files["lightning"], tmp_path / "export.pt")
    for export in ("safetensors_export", "pt_export"):  # timm alone reads the net (its head: num_classes in the cfg)
        plain = timm.create_model(
            "convnext_atto_convstem",
            num_classes=4,
            pretrained=True,
            pretrained_cfg_overlay={"file": str(files[export]), "num_classes": 4},
        )
        assert_same_logits(plain.eval(), module.model.net, images())
    files["timm_folder"] = export_timm_folder(files["lightning"], tmp_path / "folder")
    saved = {  # state dicts as other code writes them, with our normaliser's buffers beside the net's
        "plain_state_dict": {**net, **normaliser},
        "ddp_prefixed": {f"module.{k}": v for k, v in {**net, **normaliser}.items()},
        "timm_train_checkpoint": {"state_dict": {**net, **normaliser}, "epoch": 3},
        "robustbench_style": {"model": {f"model.{k}": v for k, v in net.items()} | normaliser},
    }
    for kind, content in saved.items():
        files[kind] = tmp_path / f"{kind}.pth"
        torch.save(content, files[kind])
    losses = {}
    for kind, path in files.items():
        (tmp_path / kind).mkdir()
        config = tiny_config(tmp_path / kind, **{"model.init_from": str(path)})
        assert main(["validate", "--config", str(config)]) == 0, kind
        [results] = (tmp_path / kind / "runs").glob("tiny/version_*/results.json")
        losses[kind] = json.loads(results.read_text())["validate"]["metrics"]["val/loss"]
        direct = robust_lightning.load_model("convnext_atto_convstem", path)
        assert_same_logits(direct, module.model, images())
    assert losses == pytest.approx({kind: losses["lightning"] for kind in files}, rel=1e-6)


def test_robustbench_load_model_call_reads_its_layout(tmp_path):
    """RobustBench's load_model(model_name=..., model_dir=..., dataset=..., threat_model=...) on local files in
    its layout, <model_dir>/imagenet/Linf/<model_name>.pt; nothing is downloaded."""
    name = "Singh2023Revisiting_ConvNeXt-T-ConvStem"
    net = released_convnext_t(5)
    models = tmp_path / "models"
    (models / "imagenet" / "Linf").mkdir(parents=True)
    torch.save(net.state_dict(), models / "imagenet" / "Linf" / f"{name}.pt")
    model = robust_lightning.load_model(
        model_name=name, model_dir=models, dataset="imagenet", threat_model="Linf", arch_kwargs=TINY_CONVNEXT
    )
    assert_same_logits(model, net, images())

    class ThreatModel:  # RobustBench's enums are read by their value
        value = "Linf"

    model = robust_lightning.load_model(
        name, model_dir=str(models), threat_model=ThreatModel(), arch_kwargs=TINY_CONVNEXT
    )  # the name first, as RobustBench's signature
    assert_same_logits(model, net, images())
    with pytest.warns(DeprecationWarning, match="`norm` has been deprecated"):  # RobustBench's older keyword
        model = robust_lightning.load_model(name, model_dir=models, norm="Linf", arch_kwargs=TINY_CONVNEXT)
    assert_same_logits(model, net, images())
    with pytest.raises(UserError, match="not 'imagenet', 'L2'"), pytest.warns(DeprecationWarning):
        robust_lightning.load_model(name, model_dir=models, threat_model="Linf", norm="L2")  # norm overrides

    missing = tmp_path / "elsewhere" / "imagenet" / "Linf" / f"{name}.pt"
    with pytest.raises(
        UserError,
        match=f"{missing} does not exist. RobustBench's load_model would download {name} "
        "there; nothing is downloaded here",
    ):
        robust_lightning.load_model(model_name=name, model_dir=tmp_path / "elsewhere")
    with pytest.raises(UserError, match="dataset 'imagenet', threat_model 'Linf' only .* not 'cifar10', 'Linf'"):
        robust_lightning.load_model(model_name=name, model_dir=models, dataset="cifar10")
    with pytest.raises(UserError, match="Did you mean: robustbench:Salman2020Do_R50"):
        robust_lightning.load_model(model_name="Salman2020Do_R5", model_dir=models)


def test_file_of_another_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "weights_20.pt"
    released = AttackWrapper(normalize_model(released_convnext_t(0)))
    torch.save({f"module.{k}": v for k, v in released.state_dict().items()}, path)
    with pytest.raises(UserError) as info:
        robust_lightning.load_model(
            "robustbench:Singh2023Revisiting_ViT-S-ConvStem", path, image_size=32, arch_kwargs=TINY_VIT
        )
    message = str(info.value)
    assert str(path) in message and "expected architecture 'vit_small_patch16_224_convstem'" in message
    assert "unexpected in checkpoint: stages.0" in message


def test_cli_validates_a_released_file(tmp_path):
    """--model.arch robustbench:<name> --model.init_from weights_N.pt, through the command line."""
    from helpers import run_cli, tiny_config

    raw = normalize_model(released_convnext_t(0, num_classes=4))
    path = tmp_path / "weights_20.pt"
    torch.save({f"module.{k}": v for k, v in AttackWrapper(raw).state_dict().items()}, path)
    overrides = {
        "model.arch": "robustbench:Singh2023Revisiting_ConvNeXt-T-ConvStem",
        "model.init_from": str(path),
        "model.arch_kwargs": TINY_CONVNEXT,
        "data.source.init_args.val_per_class": 2,
    }
    config = tiny_config(tmp_path, **overrides)
    result = run_cli("validate", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "input normaliser taken from the checkpoint" in result.stdout + result.stderr

    wrong = tmp_path / "vit.pt"
    torch.save(released_vit_s(1, num_classes=4).state_dict(), wrong)
    config = tiny_config(tmp_path, **{**overrides, "model.init_from": str(wrong)})
    result = run_cli("validate", "--config", str(config))
    assert result.returncode == 2
    assert str(wrong) in result.stderr and "'convnext_tiny_convstem'" in result.stderr
    assert "Traceback" not in result.stderr


def test_card_shows_the_leaderboard_numbers_of_a_robustbench_arch():
    from robust_lightning.evaluation.card import paper_rows, render_card

    results = {
        "autoattack": {
            "threat_models": {
                "Linf-4_255": {
                    "norm": "Linf",
                    "eps": 4 / 255,
                    "num_points": 50,
                    "clean_accuracy": 0.76,
                    "robust_accuracy": 0.5,
                },
            },
            "conditions": {"version": "standard", "precision": "fp32"},
        }
    }
    arch = "robustbench:Singh2023Revisiting_ConvNeXt-B-ConvStem"
    papers = paper_rows(arch)
    header = {"arch": arch, "checkpoint": "weights_249.pt", "resolution": 224, "data": {}}
    lines = render_card(header, {}, results, [], papers).splitlines()
    # the leaderboard's numbers for these weights (the paper's Table 2 has the same: 75.90 clean, 56.14 AA)
    leaderboard = "| Singh2023Revisiting_ConvNeXt-B-ConvStem, RobustBench leaderboard (224 px, these weights) |"
    assert f"{leaderboard} 75.90 | 56.14 |" in lines
    # and the paper's own rows for the architecture, with their footnote
    assert "| ConvNeXt-B + ConvStem, Singh et al. 2023 (224 px, 250 epochs) | 75.90 | 56.14 |" in lines
    assert any(line.startswith("Leaderboard numbers: data/robustbench_imagenet_linf.csv") for line in lines)
    assert any(line.startswith("Published numbers: data/paper_results.csv") for line in lines)
    salman = paper_rows("robustbench:Salman2020Do_50_2")
    # the leaderboard's numbers of these weights, then Table 2 of Singh et al. for the architecture
    assert [(p["clean"], p["autoattack_linf_4_255"]) for p in salman] == [("68.46", "38.14"), ("68.82", "38.12")]


def test_old_swin_layout(tmp_path):
    # Liu2023Comprehensive_Swin-B/L were saved by an older timm (microsoft/Swin-Transformer names): downsampling
    # at the end of a stage, head.weight, relative_position_index / attn_mask buffers
    tiny_swin = dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))
    torch.manual_seed(0)
    net = timm.create_model("swin_base_patch4_window7_224", num_classes=5, **tiny_swin)
    old = {}
    for k, v in net.state_dict().items():
        k = re.sub(r"^layers\.(\d)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", k)
        old[k.replace("head.fc.", "head.")] = v
        if k.endswith("attn.relative_position_bias_table"):
            old[k.replace("relative_position_bias_table", "relative_position_index")] = torch.zeros(49, 49).long()
    assert "layers.0.downsample.reduction.weight" in old and "head.weight" in old
    path = tmp_path / "Liu2023Comprehensive_Swin-B.pt"
    torch.save({f"module.{k}": v for k, v in old.items()}, path)
    model = robust_lightning.load_model("robustbench:Liu2023Comprehensive_Swin-B", path, arch_kwargs=tiny_swin)
    assert_same_logits(model, normalize_model(net), images(224, n=2))
