"""Signal analyses on tiny inputs and models: occlusion, frequency noise, Fourier analysis and variance of features.

Each check can fail: a zero-width band must add no noise while the bands together must add all of it; a 0%
patch drop must leave the images as they are while a 100% drop must leave nothing; a checkerboard must have a
high and a constant map a very low high-frequency amplitude; ...
"""

import pytest
import timm
import torch
import yaml

from helpers import REPO, run_analysis, shipped_analysis_config, tiny_vit, untrained_checkpoint
from robust_lightning.analysis.blocks import FeatureTap, as_map, attention_probabilities, find_blocks
from robust_lightning.analysis.frequency import band_edges, band_mask, band_noise, normalised_frequency
from robust_lightning.analysis.occlusion import (
    Occlusion,
    cls_attention,
    drop_patches,
    gradient_saliency,
    load_saliency_vit,
    mass_mask,
    random_patch_mask,
)
from robust_lightning.analysis.representation import LOG_EPS, feature_variance, relative_log_amplitude
from robust_lightning.errors import UserError

GEN = torch.Generator().manual_seed(0)


# ------------------------------------------------------------------------------------ frequency noise
def test_a_zero_width_band_adds_no_noise_and_the_bands_tile_the_spectrum():
    images = torch.rand(2, 3, 32, 30, generator=GEN)
    delta = torch.randn(2, 3, 32, 30, generator=GEN)
    empty = band_mask(32, 30, 0.4, 0.4)
    assert empty.sum() == 0 and torch.equal(images + band_noise(delta, empty), images)
    edges = band_edges(0.1)
    assert len(edges) == 10 and edges[0][0] == 0 and edges[-1][1] == 1
    masks = [band_mask(32, 30, lo, hi, closed=i == len(edges) - 1) for i, (lo, hi) in enumerate(edges)]
    assert all(m.sum() > 0 for m in masks)
    assert torch.equal(sum(masks), torch.ones(32, 30))  # disjoint and complete: every DFT bin in one band
    total = sum(band_noise(delta, m) for m in masks)
    assert torch.allclose(total, delta, atol=1e-5)
    # each band's noise has its energy in that band only
    spectrum = torch.fft.fft2(band_noise(delta, masks[7])).abs()
    assert spectrum[..., masks[7] == 0].max() < 1e-3 * spectrum[..., masks[7] == 1].max()
    freq = normalised_frequency(32, 30)
    assert freq[0, 0] == 0 and freq.max() == 1.0 and freq[16, 0] == 1.0  # pi at the Nyquist row of an even size


# ----------------------------------------------------------------------------------------- occlusion
def test_patch_drop_at_0_percent_keeps_the_image_and_at_100_percent_leaves_nothing():
    images = torch.rand(3, 3, 32, 32, generator=GEN) + 0.1
    none = random_patch_mask(3, 14, 0.0, GEN)
    assert not none.any() and torch.equal(drop_patches(images, none), images)
    every = random_patch_mask(3, 14, 1.0, GEN)
    assert every.all() and drop_patches(images, every).abs().max() == 0
    half = random_patch_mask(3, 8, 0.3, GEN)
    assert half.flatten(1).sum(1).tolist() == [19, 19, 19]  # floor(0.3 * 64) per image
    assert not torch.equal(half[0], half[1])  # drawn per image
    dropped = drop_patches(images, half)
    assert ((dropped == 0).float().mean(dim=(1, 2, 3)) == 19 / 64).all()  # 4x4-px patches of a 32-px image


def test_salient_and_non_salient_drops_split_the_saliency_mass():
    saliency = torch.tensor([[[0.7, 0.2], [0.1, 0.0]]])
    cells = lambda m: set(m.flatten().nonzero().flatten().tolist())  # noqa: E731
    assert cells(mass_mask(saliency, 0.5, salient=True)) == {0}
    assert cells(mass_mask(saliency, 0.8, salient=True)) == {0, 1}
    assert cells(mass_mask(saliency, 1.0, salient=True)) == {0, 1, 2, 3}
    assert cells(mass_mask(saliency, 0.1, salient=False)) == {2, 3}
    assert cells(mass_mask(saliency, 0.25, salient=False)) == {2, 3}
    assert cells(mass_mask(saliency, 1.0, salient=False)) == {0, 1, 2, 3}
    random = torch.rand(4, 6, 6, generator=GEN)
    for lam in (0.1, 0.35, 0.8):  # non-salient(lambda) is what salient(1 - lambda) leaves
        assert torch.equal(mass_mask(random, lam, salient=False), ~mass_mask(random, 1 - lam, salient=True))


def test_gradient_saliency_finds_the_pixels_a_model_looks_at():
    class TopLeft(torch.nn.Module):  # looks only at the top-left 8x8 pixels
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3 * 8 * 8, 4)

        def forward(self, x):
            return self.fc(x[:, :, :8, :8].flatten(1))

    torch.manual_seed(0)
    saliency = gradient_saliency(TopLeft(), torch.rand(2, 3, 32, 32, generator=GEN))
    assert saliency[:, :8, :8].min() > 0 and saliency[:, 8:].abs().max() == 0 and saliency[:, :, 8:].abs().max() == 0


def test_cls_attention_is_the_models_own_attention_and_loads_from_a_dino_style_file(tmp_path):
    vit = tiny_vit()
    x = torch.rand(2, 3, 32, 32, generator=GEN)
    last = vit.blocks[-1].attn
    last.fused_attn = False  # timm's explicit path passes the softmax weights through attn_drop
    seen = {}
    hook = last.attn_drop.register_forward_hook(lambda m, args, out: seen.setdefault("p", out))
    with torch.no_grad():
        vit(x)
    hook.remove()
    with torch.no_grad():
        saliency = cls_attention(vit, x, head=1)
    assert saliency.shape == (2, 4, 4)
    assert torch.allclose(saliency.flatten(1), seen["p"][:, 1, 0, 1:], atol=1e-6)
    # a DINO-style checkpoint file (backbone.* keys, a projection head that is not the ViT's) gives the same maps
    torch.manual_seed(0)
    dino = timm.create_model("vit_tiny_patch16_224", num_classes=0, dynamic_img_size=True).eval()
    state = {f"backbone.{k}": v for k, v in dino.state_dict().items()}
    state["head.mlp.0.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "dino.pth")
    loaded = load_saliency_vit(str(tmp_path / "dino.pth"), "vit_tiny_patch16_224")
    x64 = torch.rand(2, 3, 64, 64, generator=GEN)
    with torch.no_grad():
        assert torch.equal(cls_attention(loaded, x64, head=1), cls_attention(dino, x64, head=1))
    with pytest.raises(UserError, match="does not fit test_vit"):
        load_saliency_vit(str(tmp_path / "dino.pth"), "test_vit")
    with pytest.raises(UserError, match="saliency_checkpoint not found"):
        Occlusion(saliency="checkpoint", saliency_checkpoint=str(tmp_path / "missing.pth"))
    probs = attention_probabilities(last, torch.randn(1, 17, 192, generator=GEN))
    assert torch.allclose(probs.sum(-1), torch.ones(1, 3, 17))


# --------------------------------------------------------------------------------- Fourier, variance
def test_fourier_amplitude_of_a_constant_map_is_very_low_and_of_a_fine_pattern_high():
    constant = torch.full((2, 3, 8, 8), 2.0)
    rows, cols = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    # Park & Kim's grid on 8x8 ends on the diagonal bin (3, 3), not the Nyquist bin (4, 4) of a checkerboard
    fine = torch.cos(2 * torch.pi * 3 * (rows + cols) / 8).float().expand(2, 3, 8, 8)
    smooth = torch.cos(2 * torch.pi * rows / 8).float().expand(2, 3, 8, 8) + 1.5
    freqs, flat = relative_log_amplitude(constant)
    assert freqs.tolist() == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    assert flat[:, 0].abs().max() == 0  # relative to frequency 0
    assert torch.isfinite(flat).all() and (flat[:, -1] < torch.log(torch.tensor(LOG_EPS / (64 * 2.0))) + 1).all()
    assert (relative_log_amplitude(fine)[1][:, -1] > 10).all()
    high = relative_log_amplitude(smooth)[1][:, -1]
    assert (high < -10).all()  # a low-frequency map has nothing at pi
    _, one = relative_log_amplitude(torch.rand(2, 3, 1, 1))
    assert one.shape == (2, 1)  # a 1x1 map: frequency 0 only


def test_variance_of_a_constant_map_is_zero_and_otherwise_the_spatial_variance():
    assert torch.equal(feature_variance(torch.full((2, 4, 5, 5), 3.0)), torch.zeros(2))
    maps = torch.randn(2, 4, 5, 5, generator=GEN)
    expected = maps.flatten(2).var(dim=-1).mean(dim=1)
    assert torch.allclose(feature_variance(maps), expected)
    assert feature_variance(torch.rand(2, 4, 1, 1)).isnan().all()


def test_vit_sublayer_features_are_the_residual_stream_after_each_branch():
    vit = tiny_vit()
    bmap = find_blocks(vit)
    tap = FeatureTap(vit, bmap, sublayers=True, stem=True)
    assert [kind for _, kind in tap.points] == ["stem"] + ["attention", "mlp"] * 3
    x = torch.rand(2, 3, 32, 32, generator=GEN)
    with tap, torch.no_grad():
        vit(x)
        stem, attention, mlp = tap.ordered()[:3]
        block = vit.blocks[0]
        assert torch.allclose(attention, stem + block.attn(block.norm1(stem)), atol=1e-6)
        assert torch.allclose(mlp, block(stem), atol=1e-6)
    maps = as_map(mlp, bmap, (32, 32))
    assert maps.shape == (2, 192, 4, 4) and torch.equal(maps[:, :, 0, 1], mlp[:, 2])  # CLS dropped, row-major grid


# ------------------------------------------------------------------------------------------ end to end
def test_the_shipped_configs_run_on_tiny_checkpoints(tmp_path):
    vit = untrained_checkpoint(tmp_path, "vit_tiny_patch16_224", arch_kwargs={"patch_size": 8, "depth": 2})
    config = shipped_analysis_config(
        tmp_path,
        "occlusion_chen_fig4",
        vit,
        saliency="attention",
        interpolation=None,  # the data module's resize: the images of the test loop, whose accuracy is compared
        grid=4,
        samples=2,
        drop_fractions=[0.0, 0.5, 0.9],
        lambdas=[0.5, 1.0],
    )
    for name in ("frequency_noise_parkkim_fig2b", "fourier_features_parkkim", "feature_variance_parkkim"):
        shipped = yaml.safe_load((REPO / "configs" / "analysis" / f"{name}.yaml").read_text())
        callback = shipped["trainer"]["callbacks"][0]
        callback["init_args"] |= {"max_images": 8, "batch_size": 8}
        config["trainer"]["callbacks"].append(callback)
    status, results, run_dir = run_analysis(tmp_path, config)
    assert status == 0
    occlusion = results["occlusion"]
    assert occlusion["random"]["0"]["mean"] == occlusion["clean_accuracy"] == results["test"]["metrics"]["test/acc1"]
    assert occlusion["conditions"]["saliency"]["source"] == "attention" and set(occlusion["salient"]) == {"0.5", "1"}
    assert occlusion["salient"]["1"] == occlusion["non_salient"]["1"]  # both drop every patch
    noise = results["frequency_noise"]
    assert len(noise["bands"]) == 11 and noise["clean_accuracy"] == occlusion["clean_accuracy"]  # 0, 0.1, ..., 1 pi
    assert noise["protocol"]["follows"] == "code"
    assert all(b["drop"] == pytest.approx(noise["clean_accuracy"] - b["accuracy"]) for b in noise["bands"])
    fourier = results["fourier_features"]["points"]
    assert [p["kind"] for p in fourier] == ["stem", "attention", "mlp", "attention", "mlp"]
    # 4x4 patch grid: the code's half-diagonal has bins 0 and 1 (true frequency 0.5 pi), plotted at 0 and 1.0 pi
    assert all(
        p["frequencies"] == [0.0, 1.0] and p["dft_frequencies"] == [0.0, 0.5] and p["relative_log_amplitude"][0] == 0
        for p in fourier
    )
    variance = results["feature_variance"]["points"]
    assert len(variance) == 5 and all(p["variance"] > 0 for p in variance)
    for name in ("occlusion", "frequency_noise", "fourier_features", "feature_variance"):
        assert (run_dir / f"{name}.png").stat().st_size > 1000
