"""Model families of the analysis papers: RepLKNet, large-kernel ConvNeXt, AlterNet, ViT /16 and /32, BiT (CPU).

Full-size models are built on the meta device (shapes only); forwards use the small registered variants.
"""

import copy

import pytest
import timm
import torch
from torch import nn

from robust_lightning.models.alternet import MSABlock, PreActBottleneck, WindowAttention2d, msa_layout
from robust_lightning.models.classifier import build_classifier
from robust_lightning.models.replknet import ConvFFN, ReparamLargeKernelConv, RepLKBlock, reparameterize

NEW_MODELS = [
    "replknet_31b",
    "replknet_31l",
    "replknet_test",
    "convnext_tiny_lk",
    "convnext_small_lk",
    "convnext_base_lk",
    "convnext_lk_test",
    "alternet_50",
    "alternet_test",
]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, **kwargs) -> nn.Module:
    return timm.create_model(name, device="meta", **kwargs)


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial BN statistics and affine parameters, so that a wrong BN fold changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=gen) * 2 - 1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) * 1.5 + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=gen) * 2 - 1)


# ---------------------------------------------------------------------------------------------------------
# every small variant through build_classifier


@pytest.mark.parametrize(
    "arch, arch_kwargs, size",
    [
        ("replknet_test", {}, 64),
        ("convnext_lk_test", dict(kernel_size=51), 32),
        ("alternet_test", {}, 64),
        ("vit_base_patch32_224", dict(depth=1), 64),  # ViT-B/32, one block
        ("vit_base_patch16_224", dict(depth=1), 32),  # ViT-B/16, one block
        ("resnetv2_50x1_bit", {}, 32),  # BiT-M R50x1, full size
    ],
)
def test_builds_runs_and_trains(arch, arch_kwargs, size):
    torch.manual_seed(0)
    model = build_classifier(arch, 5, image_size=size, arch_kwargs=arch_kwargs)
    x = torch.rand(2, 3, size, size)
    out = model(x)  # train mode: BatchNorm with batch statistics, drop path off by default
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, 5)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_registered_without_weights(name):
    assert timm.is_model(name)
    cfg = timm.models.get_pretrained_cfg(name)
    assert not cfg.url and not cfg.hf_hub_id and not cfg.has_weights


# ---------------------------------------------------------------------------------------------------------
# RepLKNet


@pytest.mark.parametrize(
    "name, channels", [("replknet_31b", (128, 256, 512, 1024)), ("replknet_31l", (192, 384, 768, 1536))]
)
def test_replknet_structure(name, channels):
    model = meta_model(name)
    assert len(model.stages) == 4 and len(model.transitions) == 3
    for stage, kernel, layers, ch in zip(model.stages, (31, 29, 27, 13), (2, 2, 18, 2), channels):
        blocks = list(stage.blocks)
        assert len(blocks) == 2 * layers
        assert all(isinstance(b, RepLKBlock) for b in blocks[0::2])
        assert all(isinstance(b, ConvFFN) for b in blocks[1::2])
        lk = blocks[0].large_kernel
        assert isinstance(lk, ReparamLargeKernelConv) and (lk.kernel_size, lk.small_kernel) == (kernel, 5)
        assert lk.lkb_origin.conv.weight.shape == (ch, 1, kernel, kernel)  # depthwise
        assert lk.small_conv.conv.weight.shape == (ch, 1, 5, 5)
        assert isinstance(lk.lkb_origin.bn, nn.BatchNorm2d) and isinstance(lk.small_conv.bn, nn.BatchNorm2d)
        assert blocks[1].pw1.conv.weight.shape == (4 * ch, ch, 1, 1)  # FFN ratio 4
    assert model.num_features == channels[-1] and model.get_classifier().in_features == channels[-1]


# Ding et al. 2022 (arXiv:2203.06717), ImageNet results table: RepLKNet-31B 79M, RepLKNet-31L 172M parameters.
# Exact counts of the reference architecture with 1000 classes: 79,864,168 and 172,671,016.
@pytest.mark.parametrize("name, millions", [("replknet_31b", 79), ("replknet_31l", 172)])
def test_replknet_parameter_counts(name, millions):
    count = n_params(meta_model(name, num_classes=1000))
    assert abs(count - millions * 1e6) / (millions * 1e6) < 0.015, count


def test_replknet_keys_match_reference_checkpoints():
    # parameter names of DingXiaoH/RepLKNet-pytorch (replknet.py), so its released checkpoints load unchanged
    keys = set(timm.create_model("replknet_test", device="meta").state_dict())
    block, ffn = "stages.0.blocks.0.", "stages.0.blocks.1."
    expected = [
        "stem.0.conv.weight",
        "stem.0.bn.running_var",
        "stem.3.bn.weight",
        block + "prelkb_bn.weight",
        block + "pw1.conv.weight",
        block + "pw1.bn.weight",
        block + "pw2.conv.weight",
        block + "large_kernel.lkb_origin.conv.weight",
        block + "large_kernel.lkb_origin.bn.running_mean",
        block + "large_kernel.small_conv.conv.weight",
        block + "large_kernel.small_conv.bn.bias",
        ffn + "preffn_bn.weight",
        ffn + "pw1.conv.weight",
        ffn + "pw1.bn.weight",
        ffn + "pw2.conv.weight",
        "transitions.0.0.conv.weight",
        "transitions.0.1.bn.weight",
        "norm.weight",
        "head.weight",
        "head.bias",
    ]
    assert set(expected) <= keys
    merged = set(timm.create_model("replknet_test", small_kernel_merged=True, device="meta").state_dict())
    assert {block + "large_kernel.lkb_reparam.weight", block + "large_kernel.lkb_reparam.bias"} <= merged


def test_replknet_reparameterized_equals_unmerged():
    torch.manual_seed(0)
    model = build_classifier("replknet_test", 7)  # RobustClassifier: reparameterize finds the convs inside
    randomize_batchnorm(model)
    model.eval()
    x = torch.rand(3, 3, 64, 64)
    with torch.no_grad():
        before = model(x)
        # the small branch matters, so a merge that dropped it (or folded BN wrongly) would fail below
        lks = [m for m in model.modules() if isinstance(m, ReparamLargeKernelConv)]
        small = [lk.small_conv for lk in lks]
        for lk in lks:
            lk.small_conv = None
        assert (model(x) - before).abs().max() > 1e-2
        for lk, s in zip(lks, small):
            lk.small_conv = s

        assert reparameterize(model) is model
        after = model(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert all(lk.is_merged and lk.lkb_origin is None and lk.small_conv is None for lk in lks)
    assert lks[0].lkb_reparam.weight.shape == (16, 1, 7, 7) and lks[0].lkb_reparam.bias is not None
    keys = model.state_dict().keys()
    assert not any("lkb_origin" in k or "small_conv" in k for k in keys)

    # the merged weights load into a model built merged (the reference's small_kernel_merged) with equal outputs
    merged = build_classifier("replknet_test", 7, arch_kwargs=dict(small_kernel_merged=True))
    merged.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(x), before, rtol=1e-5, atol=1e-5)
        reparameterize(model)  # idempotent
        torch.testing.assert_close(model(x), after)


def test_replknet_timm_reparameterize_and_api():
    torch.manual_seed(0)
    net = timm.create_model("replknet_test", num_classes=4)
    randomize_batchnorm(net, seed=1)
    net.eval()
    x = torch.rand(2, 3, 48, 48)
    with torch.no_grad():
        ref = net(x)
        fused = timm.models.reparameterize_model(net)  # timm's utility calls ReparamLargeKernelConv.reparameterize
        torch.testing.assert_close(fused(x), ref, rtol=1e-5, atol=1e-5)
        assert not any(m.is_merged for m in net.modules() if isinstance(m, ReparamLargeKernelConv))  # a copy
        merged = copy.deepcopy(net).reparameterize()
        torch.testing.assert_close(merged(x), ref, rtol=1e-5, atol=1e-5)
        feats = net.forward_features(x)
        assert feats.shape == (2, 48, 2, 2) and net.forward_head(feats, pre_logits=True).shape == (2, 48)
    net.reset_classifier(3)
    assert net(x).shape == (2, 3)
    net.train().set_grad_checkpointing(True)
    net(x).sum().backward()
    assert net.stages[0].blocks[0].large_kernel.small_conv.conv.weight.grad is not None
    # lesion: a residual block replaced by identity still runs
    net.stages[2].blocks[0] = nn.Identity()
    assert net.eval()(x).shape == (2, 3)
    with pytest.raises(ValueError, match="odd"):
        timm.create_model("replknet_test", small_kernel=9, device="meta")  # larger than the 5x5 of stages 2-3
    with pytest.raises(ValueError, match="features_only"):
        timm.create_model("replknet_test", features_only=True)


# ---------------------------------------------------------------------------------------------------------
# ConvNeXt with configurable kernel size


@pytest.mark.parametrize("kernel", [3, 51])
def test_convnext_kernel_size(kernel):
    model = build_classifier("convnext_lk_test", 4, arch_kwargs=dict(kernel_size=kernel)).net
    dws = [b.conv_dw for s in model.stages for b in s.blocks]
    dims = (16, 24, 32, 48)
    assert [tuple(c.weight.shape) for c in dws] == [(d, 1, kernel, kernel) for d in dims]
    assert all(c.groups == c.in_channels and c.padding == (kernel // 2, kernel // 2) for c in dws)
    with torch.no_grad():
        assert model.eval()(torch.rand(1, 3, 32, 32)).shape == (1, 4)


def test_convnext_kernel_size_per_stage_and_validation():
    model = meta_model("convnext_tiny_lk", kernel_size=(51, 31, 13, 3))
    assert [s.blocks[0].conv_dw.kernel_size[0] for s in model.stages] == [51, 31, 13, 3]
    # only the depthwise kernels differ from timm's ConvNeXt-T (28.6M)
    ours = meta_model("convnext_tiny_lk", kernel_size=7).state_dict()
    ref = meta_model("convnext_tiny").state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}
    for bad in (4, 1, 53, (3, 5), (7, 7, 7, 8)):
        with pytest.raises(ValueError, match="odd"):
            meta_model("convnext_tiny_lk", kernel_size=bad)
    with pytest.raises(ValueError, match="kernel_size"):
        meta_model("convnext_tiny_lk", kernel_sizes=7)


# ---------------------------------------------------------------------------------------------------------
# AlterNet

ALTERNET_50_LAYOUT = [
    ["C", "C", "C"],
    ["C", "C", "C", "M"],
    ["C", "M", "C", "M", "C", "M"],
    ["C", "M", "C", "M"],
]


def layout(model):
    kind = {PreActBottleneck: "C", MSABlock: "M"}
    return [[kind[type(b)] for b in stage.blocks] for stage in model.stages]


def test_alternet_50_structure():
    # how-do-vits-work, models/alternet.py dnn_50: blocks (3, 4, 6, 4), MSA blocks (0, 1, 3, 2), heads 3/6/12/24
    model = meta_model("alternet_50")
    assert layout(model) == ALTERNET_50_LAYOUT
    for stage, width, heads in zip(model.stages, (64, 128, 256, 512), (3, 6, 12, 24)):
        for block in stage.blocks:
            if isinstance(block, MSABlock):
                attn = block.attn
                assert isinstance(attn, WindowAttention2d)
                assert (attn.num_heads, attn.head_dim, attn.window_size) == (heads, 64, 7)
                assert block.conv.weight.shape == (width, 4 * width, 1, 1)  # 4c -> c before attention
                assert attn.to_out.weight.shape == (4 * width, heads * 64, 1, 1)
            else:
                assert block.conv3.out_channels == 4 * width
    assert model.num_features == 2048
    assert msa_layout(5, 2) == [False, False, True, False, True]
    with pytest.raises(ValueError):
        msa_layout(3, 2)


def alternet_50_expected_params(num_classes=1000) -> int:
    """Parameter count of AlterNet-50 from the layer shapes of the reference (conv weights, BN affine, biases)."""

    def bottleneck(cin, w, proj):
        return 2 * cin + cin * w + 2 * w + 9 * w * w + 2 * w + w * 4 * w + (cin * 4 * w if proj else 0)

    def msa(c, heads, window=7):
        w, inner = c // 4, 64 * heads
        return 2 * c + c * w + 2 * w + w * 3 * inner + inner * c + c + (2 * window - 1) ** 2

    total, cin = 3 * 64 * 49, 64
    for stage, (w, heads) in enumerate(zip((64, 128, 256, 512), (3, 6, 12, 24))):
        for kind in ALTERNET_50_LAYOUT[stage]:
            # the first block of a stage projects the shortcut (channels change), the others do not
            total += bottleneck(cin, w, proj=cin != 4 * w) if kind == "C" else msa(4 * w, heads)
            cin = 4 * w
    return total + 2 * 2048 + 2048 * num_classes + num_classes


def test_alternet_50_parameter_count():
    # The paper prints no parameter count for AlterNet-50; the reference's layer shapes give 35.9M. It is larger
    # than ResNet-50 (25.6M, He et al. 2016): a fourth block in stage 4 and MSA blocks with 64-dim heads (stage
    # 4: 24 heads, 6.5M per block against 4.5M for a bottleneck).
    count = n_params(meta_model("alternet_50", num_classes=1000))
    assert count == alternet_50_expected_params()
    assert 1.3 < count / 25.557e6 < 1.5


def test_alternet_test_structure_and_api():
    torch.manual_seed(0)
    model = timm.create_model("alternet_test", num_classes=3).eval()
    assert layout(model) == [["C"], ["C", "M"], ["C", "M"], ["C", "M"]]
    for stage in model.stages[1:]:  # the last block of stages 1-3 is an MSA block with .attn
        assert isinstance(stage.blocks[-1], MSABlock) and isinstance(stage.blocks[-1].attn, WindowAttention2d)
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 128, 2, 2)
        assert model(torch.rand(1, 3, 72, 40)).shape == (1, 3)  # map sides not multiples of the window
        # lesion: the MSA block's residual branch is its attention path (no MLP), so removing the attention
        # means replacing the block by an identity
        model.stages[2].blocks[1] = nn.Identity()
        assert model(x).shape == (2, 3)
    model.train().set_grad_checkpointing(True)
    model(x).sum().backward()
    assert model.stages[1].blocks[1].attn.pos_embedding.grad is not None
    features = timm.create_model("alternet_test", features_only=True)
    assert [tuple(f.shape) for f in features(x)] == [(2, 32, 16, 16), (2, 64, 8, 8), (2, 96, 4, 4), (2, 128, 2, 2)]


def test_window_attention_padding_and_position_bias():
    torch.manual_seed(0)
    exact = WindowAttention2d(8, 12, num_heads=2, head_dim=4, window_size=5)
    padded = WindowAttention2d(8, 12, num_heads=2, head_dim=4, window_size=7)
    padded.load_state_dict({k: v for k, v in exact.state_dict().items() if k != "pos_embedding"}, strict=False)
    with torch.no_grad():
        exact.pos_embedding.zero_()
        padded.pos_embedding.zero_()
        x = torch.randn(2, 8, 5, 5)
        # one 5x5 window == the 5x5 map padded to 7x7 with the padded keys masked out
        torch.testing.assert_close(padded(x), exact(x), rtol=1e-5, atol=1e-5)
        # bias[query, key] is indexed by (key - query): the diagonal is the centre of the table
        exact.pos_embedding[4, 4] = 1.0
        bias = exact.relative_position_bias()
        assert bias.shape == (25, 25) and torch.equal(bias, torch.eye(25))
        exact.pos_embedding.zero_()
        exact.pos_embedding[4, 5] = 1.0  # key one column right of the query
        assert exact.relative_position_bias()[0, 1] == 1 and exact.relative_position_bias()[1, 0] == 0


# ---------------------------------------------------------------------------------------------------------
# ViT (patch 16 and 32) and BiT from timm


# Dosovitskiy et al. 2021, Table 1: ViT-Base 86M, ViT-Large 307M (the patch size changes only the patch embedding).
@pytest.mark.parametrize(
    "name, millions",
    [
        ("vit_base_patch16_224", 86),
        ("vit_base_patch32_224", 86),
        ("vit_large_patch16_224", 307),
        ("vit_large_patch32_224", 307),
    ],
)
def test_vit_parameter_counts(name, millions):
    count = n_params(meta_model(name, num_classes=1000))
    assert abs(count - millions * 1e6) / (millions * 1e6) < 0.03, count


def test_vit_patch32_through_build_classifier():
    model = build_classifier("vit_base_patch32_224", 10, image_size=64, arch_kwargs=dict(depth=1)).net
    assert model.patch_embed.proj.kernel_size == (32, 32) and model.patch_embed.proj.stride == (32, 32)
    assert model.patch_embed.grid_size == (2, 2) and model.pos_embed.shape == (1, 5, 768)
    assert hasattr(model.blocks[0], "attn") and hasattr(model.blocks[0], "mlp")


# BiT (Kolesnikov et al. 2020) ResNet-v2 with GroupNorm + weight standardisation: same convs as ResNet-50/101
# (He et al. 2016: 25.6M / 44.5M), GroupNorm affine in place of BatchNorm.
@pytest.mark.parametrize("name, millions", [("resnetv2_50x1_bit", 25.6), ("resnetv2_101x1_bit", 44.5)])
def test_bit_parameter_counts_and_structure(name, millions):
    model = meta_model(name, num_classes=1000)
    count = n_params(model)
    assert abs(count - millions * 1e6) / (millions * 1e6) < 0.01, count
    assert [len(s.blocks) for s in model.stages] == ([3, 4, 6, 3] if "50x1" in name else [3, 4, 23, 3])
