"""Checkpoint reading and warm start (CPU, small models, offline)."""

import re
import socket

import pytest
import safetensors.torch
import timm
import torch
from timm.layers import resample_abs_pos_embed

import robust_lightning  # noqa: F401  (registers the models with timm)
from robust_lightning.errors import UserError
from robust_lightning.models.checkpoints import read_checkpoint, read_state_dict, save_net_weights
from robust_lightning.models.classifier import build_classifier
from robust_lightning.models.weights import WarmStartReport, load_pretrained


class NotATensor:
    """A custom class: pickling an instance makes a checkpoint that weights_only loading must refuse."""

    def __init__(self):
        self.payload = [1, 2, 3]


@pytest.fixture
def no_network(monkeypatch):
    """Fail any attempt to open a network connection (proves loading is offline)."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture(scope="module")
def atto_source():
    """A PatchStem ConvNeXt (convnext_atto) whose weights we warm-start from."""
    torch.manual_seed(0)
    return build_classifier("convnext_atto", 10)


def write_lightning_ckpt(model, path, extra_prefix=""):
    sd = {f"{extra_prefix}model.{k}": v for k, v in model.state_dict().items()}  # LightningModule.model = model
    torch.save({"state_dict": sd, "epoch": 3, "global_step": 10, "hyper_parameters": {"arch": "x"}}, path)


def save_in_format(model, path, fmt):
    if fmt == "lightning":
        write_lightning_ckpt(model, path)
    elif fmt == "ddp_pt":
        torch.save({f"module.{k}": v for k, v in model.net.state_dict().items()}, path)
    elif fmt == "safetensors":
        safetensors.torch.save_file({k: v.contiguous() for k, v in model.net.state_dict().items()}, str(path))
    elif fmt == "timm_train":
        torch.save({"epoch": 1, "arch": "convnext_atto", "state_dict": model.net.state_dict()}, path)


@pytest.mark.parametrize(
    "fmt,suffix",
    [("lightning", ".ckpt"), ("ddp_pt", ".pt"), ("safetensors", ".safetensors"), ("timm_train", ".pth.tar")],
)
def test_convnext_patchstem_to_convstem(tmp_path, atto_source, fmt, suffix):
    path = tmp_path / f"src{suffix}"
    save_in_format(atto_source, path, fmt)
    torch.manual_seed(1)
    target = build_classifier("convnext_atto_convstem", 10)
    fresh_stem = {k: v.clone() for k, v in target.net.state_dict().items() if k.startswith("stem.")}

    report = load_pretrained(target, path)

    assert isinstance(report, WarmStartReport) and report.source == str(path)
    src_sd = atto_source.net.state_dict()
    tgt_sd = target.net.state_dict()
    non_stem = [k for k in tgt_sd if not k.startswith("stem.")]
    assert sorted(report.loaded) == sorted(non_stem)
    for k in non_stem:
        torch.testing.assert_close(tgt_sd[k], src_sd[k], rtol=0, atol=0)
    assert sorted(report.newly_initialized) == sorted(fresh_stem)  # stem.0, 1, 3, 4 weight/bias
    for k, v in fresh_stem.items():
        torch.testing.assert_close(tgt_sd[k], v, rtol=0, atol=0)  # stem kept at its fresh init
    assert sorted(report.dropped) == ["stem.0.bias", "stem.0.weight", "stem.1.bias", "stem.1.weight"]
    text = str(report)
    assert text.startswith(f"loaded {len(non_stem)} tensors from {path}")
    assert "newly initialised" in text and "stem.0.weight" in text and "ConvStem" in text


def test_same_architecture_roundtrip_and_new_head(tmp_path):
    torch.manual_seed(0)
    src = build_classifier("convnext_atto_convstem", 1000, mean=(0.5,) * 3, std=(0.5,) * 3)
    path = tmp_path / "last.ckpt"
    write_lightning_ckpt(src, path)
    dst = build_classifier("convnext_atto_convstem", 1000, mean=(0.5,) * 3, std=(0.5,) * 3)
    report = load_pretrained(dst, path)
    assert report.newly_initialized == [] and report.dropped == []
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v, rtol=0, atol=0)

    # 1000-class checkpoint into a 10-class model: an error unless a new head is asked for
    small = build_classifier("convnext_atto_convstem", 10)
    with pytest.raises(UserError, match=r"head\.fc\.weight checkpoint \(1000, 320\) vs model \(10, 320\)"):
        load_pretrained(small, path)
    report = load_pretrained(small, path, new_head=True)
    assert sorted(report.newly_initialized) == ["head.fc.bias", "head.fc.weight"]
    torch.testing.assert_close(small.net.stem[0].weight, src.net.stem[0].weight)


def test_mismatch_lists_keys_and_names_architecture(tmp_path, atto_source):
    path = tmp_path / "atto.ckpt"
    write_lightning_ckpt(atto_source, path)
    target = build_classifier("convnext_tiny", 10)
    with pytest.raises(UserError) as info:
        load_pretrained(target, path)
    msg = str(info.value)
    assert "'convnext_tiny'" in msg and str(path) in msg
    assert "shape mismatch: stem.0.weight checkpoint (40, 3, 4, 4) vs model (96, 3, 4, 4)" in msg
    # tiny has 3 blocks in stage 0, atto 2: the extra blocks are missing from the checkpoint
    assert re.search(r"\d+ shape mismatches, 0 unexpected and 54 missing keys", msg)
    assert "more" in msg and msg.count("\n  ") <= 21  # capped list


def test_stem_mismatch_rejected_without_allow_new_stem(tmp_path, atto_source):
    path = tmp_path / "atto.pt"
    torch.save(atto_source.net.state_dict(), path)
    with pytest.raises(UserError, match="allow_new_stem"):
        load_pretrained(build_classifier("convnext_atto_convstem", 10), path, allow_new_stem=False)
    # a PatchStem model never accepts a different stem
    other = build_classifier("test_convnext", 10)
    other.net.stem[0] = torch.nn.Conv2d(3, 24, 2, 2)
    bad = tmp_path / "bad.pt"
    torch.save(other.net.state_dict(), bad)
    with pytest.raises(UserError, match="stem.0.weight"):
        load_pretrained(build_classifier("test_convnext", 10), bad)


def test_vit_warm_start_resamples_pos_embed(tmp_path):
    torch.manual_seed(0)
    src = build_classifier("vit_small_patch16_224", 10, arch_kwargs=dict(depth=2))  # 14x14 grid
    path = tmp_path / "vit.safetensors"
    save_net_weights(src, path)
    dst = build_classifier("vit_small_patch16_224_convstem", 10, image_size=64, arch_kwargs=dict(depth=2))
    report = load_pretrained(dst, path)

    expected_pos = resample_abs_pos_embed(src.net.pos_embed.detach(), new_size=[4, 4], num_prefix_tokens=1)
    torch.testing.assert_close(dst.net.pos_embed.detach(), expected_pos)
    for k, v in src.net.state_dict().items():
        if not k.startswith(("patch_embed.", "pos_embed")):
            torch.testing.assert_close(dst.net.state_dict()[k], v, rtol=0, atol=0)
    assert all(k.startswith("patch_embed.proj.") for k in report.newly_initialized)
    assert len(report.newly_initialized) == 18  # 5 convs + 4 LNs, weight and bias each
    assert sorted(report.dropped) == ["patch_embed.proj.bias", "patch_embed.proj.weight"]
    assert "pos_embed resampled from a 14x14 to a 4x4 grid" in str(report)
    with torch.no_grad():
        assert dst(torch.rand(1, 3, 64, 64)).shape == (1, 10)


def test_vit_medium_no_embed_class_resample(tmp_path):
    torch.manual_seed(0)
    src = build_classifier("deit3_medium_patch16_224", 10, arch_kwargs=dict(depth=1))
    path = tmp_path / "deit3.pt"
    torch.save({"model": src.net.state_dict()}, path)  # DeiT release style: weights under 'model'
    dst = build_classifier("vit_medium_patch16_224_convstem", 10, image_size=32, arch_kwargs=dict(depth=1))
    load_pretrained(dst, path)
    # no_embed_class: pos_embed covers only the patches (no class-token entry), 14x14 -> 2x2
    expected = resample_abs_pos_embed(src.net.pos_embed.detach(), new_size=[2, 2], num_prefix_tokens=0)
    torch.testing.assert_close(dst.net.pos_embed.detach(), expected)
    torch.testing.assert_close(dst.net.cls_token, src.net.cls_token)
    torch.testing.assert_close(dst.net.blocks[0].ls1.gamma, src.net.blocks[0].ls1.gamma)


def test_reference_convstem_layout_is_mapped(tmp_path):
    # nmndeep/revisiting-at nests the ConvStem one level deeper (stem.stem.N.*) and wraps a normaliser
    torch.manual_seed(0)
    src = build_classifier("convnext_atto_convstem", 10)
    sd = {("stem." + k if k.startswith("stem.") else k): v for k, v in src.net.state_dict().items()}
    sd = {f"model.{k}": v for k, v in sd.items()}
    sd["normalize.mean"] = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    sd["normalize.std"] = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    path = tmp_path / "ref.pt"
    torch.save(sd, path)
    dst = build_classifier("convnext_atto_convstem", 10)
    report = load_pretrained(dst, path)
    assert report.newly_initialized == []
    torch.testing.assert_close(dst.net.stem[3].weight, src.net.stem[3].weight)
    assert set(report.checkpoint_normalize) == {"mean", "std"}
    assert "different input normaliser" in str(report)  # dst takes raw [0,1] input


def test_read_checkpoint_prefixes_and_normalizer(tmp_path):
    model = build_classifier("test_convnext", 10, mean=(0.1, 0.2, 0.3), std=(1.0, 2.0, 3.0))
    sd = {f"_orig_mod.module.model.{k}": v for k, v in model.state_dict().items()}
    path = tmp_path / "wrapped.ckpt"
    torch.save({"state_dict": sd, "loops": {"fit": 1}}, path)
    ckpt = read_checkpoint(path)
    assert set(ckpt.state_dict) == set(model.net.state_dict())
    torch.testing.assert_close(ckpt.normalize["mean"].flatten(), torch.tensor([0.1, 0.2, 0.3]))
    assert set(read_state_dict(path)) == set(model.net.state_dict())
    # our own normaliser is not touched by warm start
    target = build_classifier("test_convnext", 10, mean=(0.1, 0.2, 0.3), std=(1.0, 2.0, 3.0))
    report = load_pretrained(target, path)
    assert "normaliser" not in str(report)


def test_missing_and_unreadable_files(tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(UserError, match=f"checkpoint not found: {missing}"):
        read_state_dict(missing)
    with pytest.raises(UserError, match="checkpoint not found"):
        load_pretrained(build_classifier("test_convnext", 10), missing)

    evil = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "extra": NotATensor()}, evil)
    with pytest.raises(UserError, match=r"refusing to load .*NotATensor.*weights_only=True"):
        read_state_dict(evil)

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint" * 8)
    with pytest.raises(UserError, match="cannot read checkpoint"):
        read_state_dict(garbage)
    bad_st = tmp_path / "garbage.safetensors"
    bad_st.write_bytes(b"\x00" * 64)
    with pytest.raises(UserError, match="cannot read safetensors"):
        read_state_dict(bad_st)
    no_tensors = tmp_path / "empty.pt"
    torch.save({"epoch": 1}, no_tensors)
    with pytest.raises(UserError, match="no state dict"):
        read_state_dict(no_tensors)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_timm_pretrained_tag_from_local_file(tmp_path, no_network, suffix):
    torch.manual_seed(0)
    src = build_classifier("test_convnext.r160_in1k", 1000)
    path = save_net_weights(src, tmp_path / f"test_convnext{suffix}")
    net = timm.create_model("test_convnext.r160_in1k", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    for k, v in src.net.state_dict().items():
        torch.testing.assert_close(net.state_dict()[k], v, rtol=0, atol=0)


def test_timm_pretrained_file_for_convstem_model(tmp_path, no_network):
    torch.manual_seed(0)
    src = build_classifier("convnext_atto_convstem", 1000, mean=(0.5,) * 3, std=(0.5,) * 3)
    path = save_net_weights(src, tmp_path / "atto_convstem.safetensors")
    net = timm.create_model("convnext_atto_convstem", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    torch.testing.assert_close(net.stem[0].weight, src.net.stem[0].weight, rtol=0, atol=0)
    # and our own reader sees the file too (normaliser kept in the safetensors metadata, not as tensors)
    assert set(read_state_dict(path)) == set(src.net.state_dict())


def test_original_release_layouts_are_mapped(tmp_path, atto_source):
    # facebookresearch/ConvNeXt names (downsample_layers / dwconv / pwconv, Linear MLP weights)
    fb = {}
    for k, v in atto_source.net.state_dict().items():
        k2 = re.sub(r"^stem\.", "downsample_layers.0.", k)
        k2 = re.sub(r"^stages\.(\d)\.downsample\.", r"downsample_layers.\1.", k2)
        k2 = re.sub(r"^stages\.(\d)\.blocks\.", r"stages.\1.", k2)
        k2 = k2.replace("conv_dw", "dwconv").replace("mlp.fc", "pwconv")
        k2 = k2.replace("head.fc.", "head.").replace("head.norm.", "norm.")
        fb[k2] = v.flatten(1) if "pwconv" in k2 and v.ndim == 4 else v  # atto uses 1x1 convs, FB Linear
    path = tmp_path / "fb.pth"
    torch.save({"model": fb}, path)
    dst = build_classifier("convnext_atto", 10)
    report = load_pretrained(dst, path)
    assert "facebookresearch/ConvNeXt layout" in str(report)
    for k, v in atto_source.net.state_dict().items():
        torch.testing.assert_close(dst.net.state_dict()[k], v, rtol=0, atol=0)

    # DeiT-III release: layer scale stored as blocks.N.gamma_1 / gamma_2
    src = build_classifier("deit3_medium_patch16_224", 10, arch_kwargs=dict(depth=1))
    sd = {re.sub(r"\.ls([12])\.gamma$", r".gamma_\1", k): v for k, v in src.net.state_dict().items()}
    assert "blocks.0.gamma_1" in sd
    path = tmp_path / "deit3.pth"
    torch.save({"model": sd}, path)
    dst = build_classifier("deit3_medium_patch16_224", 10, arch_kwargs=dict(depth=1))
    load_pretrained(dst, path)
    torch.testing.assert_close(dst.net.blocks[0].ls2.gamma, src.net.blocks[0].ls2.gamma, rtol=0, atol=0)

    # Liu et al.'s isotropic ConvNeXt names
    src = build_classifier("convnext_iso_small", 10, arch_kwargs=dict(depth=1))
    sd = {
        k.replace("conv_dw", "dwconv").replace("mlp.fc1", "pwconv1").replace("mlp.fc2", "pwconv2"): v
        for k, v in src.net.state_dict().items()
    }
    path = tmp_path / "iso.pth"
    torch.save({"model": sd}, path)
    dst = build_classifier("convnext_iso_small", 10, arch_kwargs=dict(depth=1))
    load_pretrained(dst, path)
    torch.testing.assert_close(dst.net.blocks[0].mlp.fc2.weight, src.net.blocks[0].mlp.fc2.weight, rtol=0, atol=0)
