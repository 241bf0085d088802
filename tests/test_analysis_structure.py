"""Structure analyses on tiny models: block discovery, lesions, layer correlation, restricted attention.

Each check can fail: a lesion of an identity-initialised block must change nothing while a lesion of a live block
must change the output; a mask of infinite radius must equal no mask while a radius-0 mask must not; ...
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from helpers import REPO, run_analysis, shipped_analysis_config, tiny, tiny_vit, untrained_checkpoint
from robust_lightning.analysis.attention import (
    RestrictedAttention,
    cls_only_mask,
    local_mask,
    masked,
    patch_permutation,
    permuted_mask,
)
from robust_lightning.analysis.blocks import find_blocks, lesioned, removable_units
from robust_lightning.analysis.lesion import LesionStudy
from robust_lightning.analysis.representation import CorrelationAccumulator, LayerCorrelation
from robust_lightning.errors import UserError

X = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def module_with(net) -> SimpleNamespace:
    """What Analysis.check reads of a LightningModule."""
    return SimpleNamespace(model=SimpleNamespace(net=net))


@torch.no_grad()
def out(net, x=X):
    return net(x)


# ---------------------------------------------------------------------------------------- discovery
@pytest.mark.parametrize(
    "arch, kwargs, family, units, parts",
    [
        ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=3), "vit", 3, ["attention", "mlp"]),
        ("test_convnext", {}, "convnext", 9, []),
        ("test_resnet", {}, "resnet", 4, []),
        ("convnext_iso_small", dict(depth=2, dim=48), "isotropic_convnext", 2, []),
        ("replknet_test", {}, "replknet", None, ["large_kernel", "mlp"]),
        ("alternet_test", {}, "alternet", None, ["attention"]),
    ],
)
def test_every_family_has_its_blocks_found(arch, kwargs, family, units, parts):
    net = tiny(arch, **kwargs)
    bmap = find_blocks(net)
    assert bmap.family == family and bmap.part_names() == parts
    if units is not None:
        assert len(bmap.units) == units
    removable, fixed = removable_units(net, bmap, X)
    assert fixed == [] and len(removable) == len(bmap.units)
    assert bmap.tokens == (family == "vit") and bmap.has_cls == (family == "vit")
    if family == "replknet":  # a RepLK block and its ConvFFN are one unit, as Chen et al. count them
        assert all(len(u.paths) == 2 for u in bmap.units)
    reference = out(net)
    for unit in bmap.units:  # every lesion runs, and the model is whole again afterwards
        for part in ["block", *unit.parts]:
            with lesioned(net, [unit], part):
                assert out(net).shape == reference.shape
    assert torch.equal(out(net), reference)


def test_unknown_architectures_and_non_vits_are_refused_clearly():
    with pytest.raises(UserError, match="cannot find the residual blocks of a Linear"):
        find_blocks(torch.nn.Linear(2, 2))
    resnet = find_blocks(tiny("test_resnet"))
    with pytest.raises(UserError, match="needs a Vision Transformer.*resnet model.*does not apply"):
        resnet.require_attention("RestrictedAttention")
    with pytest.raises(UserError, match="needs a model with a CLS token"):
        resnet.require_cls("LayerCorrelation")


# -------------------------------------------------------------------------------------------- lesions
def test_removing_an_identity_initialised_block_changes_nothing():
    vit = tiny_vit(init_values=1e-5)  # layer scale: zero it and block 1 computes the identity
    unit = find_blocks(vit).units[1]
    with lesioned(vit, [unit]):
        lesioned_live = out(vit)
    assert not torch.allclose(lesioned_live, out(vit), atol=1e-6)  # a live block matters
    vit.blocks[1].ls1.gamma.data.zero_()
    vit.blocks[1].ls2.gamma.data.zero_()
    with lesioned(vit, [unit]):
        assert torch.allclose(out(vit), out(vit.train(False)), atol=1e-6, rtol=0)

    convnext = tiny("test_convnext")
    unit = find_blocks(convnext).units[2]  # stages.1.blocks.0
    convnext.get_submodule(unit.paths[0]).gamma.data.zero_()
    intact = out(convnext)
    with lesioned(convnext, [unit]):
        assert torch.allclose(out(convnext), intact, atol=1e-6, rtol=0)

    resnet = tiny("test_resnet")  # layer1.0: a BasicBlock with an identity shortcut
    block = resnet.layer1[0]
    assert block.downsample is None
    block.bn2.weight.data.zero_()
    block.bn2.bias.data.zero_()
    intact = out(resnet)
    with lesioned(resnet, find_blocks(resnet).units[:1]):
        assert torch.allclose(out(resnet), intact, atol=1e-6, rtol=0)


def test_attention_only_lesion_equals_the_block_lesion_when_the_mlp_is_zero():
    vit = tiny_vit(init_values=1e-5)
    unit = find_blocks(vit).units[0]
    with lesioned(vit, [unit], "attention"):
        attention_only = out(vit)
    with lesioned(vit, [unit]):
        whole = out(vit)
    assert not torch.allclose(attention_only, whole, atol=1e-6)  # the MLP is still live
    vit.blocks[0].ls2.gamma.data.zero_()
    with lesioned(vit, [unit], "attention"):
        attention_only = out(vit)
    with lesioned(vit, [unit], "mlp"):
        mlp_only = out(vit)
    with lesioned(vit, [unit]):
        whole = out(vit)
    assert torch.allclose(attention_only, whole, atol=1e-6, rtol=0)
    assert not torch.allclose(mlp_only, whole, atol=1e-6)


def test_a_replknet_pair_without_both_parts_is_the_pair_removed():
    net = tiny("replknet_test")
    unit = find_blocks(net).units[2]
    with lesioned(net, [unit], "large_kernel"), lesioned(net, [unit], "mlp"):
        both = out(net)
    with lesioned(net, [unit]):
        assert torch.equal(out(net), both)
    with lesioned(net, [unit], "mlp"):
        assert not torch.allclose(out(net), both, atol=1e-6)


def test_lesion_modes_a_model_does_not_have_are_refused_before_the_test():
    convnext = module_with(tiny("test_convnext"))
    with pytest.raises(UserError, match="convnext model has no 'attention' branch.*does not apply"):
        LesionStudy(modes=["block", "attention"]).check(None, convnext)
    with pytest.raises(UserError, match="random_stages"):
        LesionStudy(random_stages=[7]).check(None, convnext)
    LesionStudy(modes=None).check(None, convnext)  # the default: what the model has
    vit = module_with(tiny_vit())
    LesionStudy(modes=["attention", "mlp"], random_counts=[2], random_parts=["mlp"]).check(None, vit)
    with pytest.raises(UserError, match="convnext model has no 'mlp' branch"):
        LesionStudy(random_parts=["block", "mlp"]).check(None, convnext)
    LesionStudy(random_parts=None, random_counts=[2]).check(None, convnext)  # null: what the model has
    with pytest.raises(UserError, match="random_counts \\[3, 4\\]: this vit model has only 2 units"):
        LesionStudy(random_counts=[2, 3, 4]).check(None, vit)  # the first block is always kept


# --------------------------------------------------------------------------------------- correlation
def test_correlation_of_a_layer_with_itself_is_one_and_matches_numpy():
    gen = torch.Generator().manual_seed(1)
    acc = CorrelationAccumulator()
    batches = []
    for _ in range(3):  # accumulated over batches
        a = torch.randn(4, 5, 6, generator=gen)
        b = 0.5 * a + torch.randn(4, 5, 6, generator=gen)
        batches.append((a, b))
        acc.add([a, b, -a, torch.randn(4, 7, generator=gen), torch.ones(4, 5, 6)])
    corr = acc.matrix(5)
    assert torch.allclose(corr.diagonal()[:4], torch.ones(4, dtype=torch.float64))
    assert corr[0, 2].item() == pytest.approx(-1.0)
    a = torch.cat([x for x, _ in batches]).flatten().numpy()
    b = torch.cat([y for _, y in batches]).flatten().numpy()
    assert corr[0, 1].item() == pytest.approx(np.corrcoef(a, b)[0, 1], abs=1e-9)
    assert corr[0, 3].isnan() and corr[4, 4].isnan()  # other shape; constant feature: undefined


def test_cls_correlation_does_not_apply_to_convnets():
    with pytest.raises(UserError, match="CLS token.*tokens: \\[all\\]"):
        LayerCorrelation(tokens=["all", "cls"]).check(None, module_with(tiny("test_resnet")))
    LayerCorrelation(tokens=["all"]).check(None, module_with(tiny("test_resnet")))
    with pytest.raises(UserError, match="tokens"):
        LayerCorrelation(tokens=["patch"])


# --------------------------------------------------------------------------------- restricted attention
def test_masks_keep_their_promises():
    grid, prefix = (4, 5), 1
    full = local_mask(grid, prefix, float("inf"))
    assert full.all()
    zero = local_mask(grid, prefix, 0)
    assert zero[0].all() and zero[:, 0].all()  # CLS always allowed, both ways
    assert torch.equal(zero[1:, 1:], torch.eye(20, dtype=torch.bool))
    near = local_mask(grid, prefix, 1)  # |dy| <= 1 and |dx| <= 1: the 8-neighbourhood
    assert near[1:, 1:].sum(1).tolist()[:2] == [4, 6]
    shuffled = permuted_mask(near, prefix, patch_permutation(20, 0))
    assert shuffled.sum() == near.sum() and not torch.equal(shuffled, near)
    assert sorted(shuffled.sum(1).tolist()) == sorted(near.sum(1).tolist())
    assert shuffled[:, 0].all() and shuffled[0].all() and shuffled.diagonal().all()
    only = cls_only_mask(grid, prefix)
    assert only[1:, 1:].sum() == 0 and only[:, 0].all() and only[0].all()


def test_an_infinite_radius_is_no_mask_and_a_zero_radius_is_not():
    vit = tiny_vit()
    bmap = find_blocks(vit)
    reference = out(vit)
    everywhere = lambda mask: {i: mask for i in range(len(bmap.units))}  # noqa: E731
    with masked(vit, bmap, everywhere(local_mask((4, 4), 1, float("inf")))):
        assert torch.allclose(out(vit), reference, atol=1e-5, rtol=0)
    with masked(vit, bmap, everywhere(local_mask((4, 4), 1, 0))):
        assert not torch.allclose(out(vit), reference, atol=1e-4)
    assert torch.equal(out(vit), reference)  # the wrappers are gone again


def test_restricted_attention_does_not_apply_to_convnets():
    with pytest.raises(UserError, match="needs a Vision Transformer.*convnext model.*does not apply"):
        RestrictedAttention().check(None, module_with(tiny("test_convnext")))
    with pytest.raises(UserError, match="has 3 blocks"):
        RestrictedAttention(cls_only=[4]).check(None, module_with(tiny_vit()))


# ------------------------------------------------------------------------------------------ end to end


def test_the_shipped_configs_run_on_tiny_checkpoints(tmp_path, capsys):
    # lesion_bhojanapalli_fig8.yaml on a quickstart-shaped ConvNet (10 synthetic classes, 32 px)
    resnet = untrained_checkpoint(tmp_path, "test_resnet")
    config = shipped_analysis_config(tmp_path, "lesion_bhojanapalli_fig8", resnet, random_counts=[1, 3], samples=2)
    callback = yaml.safe_load((REPO / "configs" / "analysis" / "layer_correlation_bhojanapalli.yaml").read_text())
    callback = callback["trainer"]["callbacks"][0]
    callback["init_args"] |= {"max_images": 8, "batch_size": 8, "tokens": ["all"]}
    config["trainer"]["callbacks"].append(callback)
    status, results, run_dir = run_analysis(tmp_path, config)
    assert status == 0
    cka = results["layer_correlation"]  # stages of different shapes: linear CKA, no empty cell
    assert cka["measures"] == {"all": "linear_cka"} and all(v is not None for row in cka["all"] for v in row)
    lesion = results["lesion"]
    assert lesion["family"] == "resnet" and list(lesion["single"]) == ["block"] and len(lesion["single"]["block"]) == 4
    assert list(lesion["random"]) == ["block"]  # random_parts null: a ResNet's units have no parts
    drawn = lesion["random"]["block"]
    assert drawn["3"]["samples"] == 2 and len(drawn["3"]["removed"][0]) == 3
    assert 0 <= drawn["1"]["min"] <= drawn["1"]["mean"] <= drawn["1"]["max"] <= 1
    assert (run_dir / "lesion.png").stat().st_size > 1000 and lesion["plot"].endswith("lesion.png")
    with Image.open(run_dir / "lesion.png") as plot:  # a whole PNG (written beside it, then renamed)
        assert plot.format == "PNG" and plot.size[0] > 100
        plot.load()
    assert sorted(p.name for p in run_dir.glob(".*")) == []  # no staged file left

    # a ViT-only config on the ConvNet: one clear message, exit status 2, no traceback
    config = shipped_analysis_config(tmp_path, "restricted_attention_bhojanapalli", resnet)
    capsys.readouterr()
    assert run_analysis(tmp_path, config, "restricted.yaml")[0] == 2
    err = capsys.readouterr().err
    assert "does not apply" in err and "Traceback" not in err

    # the Bhojanapalli configs together on a tiny ViT: correlation, restricted attention and the lesion modes
    vit = untrained_checkpoint(tmp_path, "vit_tiny_patch16_224", arch_kwargs={"patch_size": 8, "depth": 3})
    config = shipped_analysis_config(
        tmp_path,
        "restricted_attention_bhojanapalli",
        vit,
        distances=[0, 1, float("inf")],
        permutations=1,
        cls_only=[1, 3],
    )
    for name, args in (
        ("layer_correlation_bhojanapalli", {}),
        ("lesion_bhojanapalli_fig8", {"random_counts": [2], "samples": 2}),
    ):
        shipped = yaml.safe_load((REPO / "configs" / "analysis" / f"{name}.yaml").read_text())
        callback = shipped["trainer"]["callbacks"][0]
        callback["init_args"] |= {"max_images": 8, "batch_size": 8, **args}
        config["trainer"]["callbacks"].append(callback)
    status, results, run_dir = run_analysis(tmp_path, config, "vit.yaml")
    assert status == 0
    restricted = results["restricted_attention"]
    assert restricted["grid"] == [4, 4] and restricted["num_prefix_tokens"] == 1
    unrestricted = next(r for r in restricted["local"] if r["distance"] == "inf")
    assert unrestricted["local_accuracy"] == restricted["full_accuracy"]
    assert unrestricted["allowed_pairs"] == 17 * 17 and restricted["local"][0]["allowed_pairs"] == 17 * 17 - 16 * 15
    assert [r["allowed_patch_pairs"] for r in restricted["local"]] == [16, 100, 256]  # d = 0, 1, inf on 4x4
    assert restricted["local"][1]["allowed_fraction"] == 100 / 256 and restricted["protocol"]["follows"] == "paper"
    assert [e["k"] for e in restricted["cls_only"]["last"]] == [1, 3]
    correlation = results["layer_correlation"]
    assert len(correlation["layers"]) == 3 and all(
        correlation[k][i][i] == pytest.approx(1) for k in ("all", "cls") for i in range(3)
    )
    assert set(results["lesion"]["single"]) == {"block", "attention", "mlp"}
    for name in ("restricted_attention", "layer_correlation", "lesion"):
        assert (run_dir / f"{name}.png").is_file()
