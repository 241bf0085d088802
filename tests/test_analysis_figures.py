"""Every analysis config names its paper figure and runs out of the box on a model of that paper's family (the
tiny quickstart models of configs/quickstart_<family>.yaml), and every analysis PNG has the axes, units and
legend entries of the figure it reproduces."""

import json
import re
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from robust_lightning.analysis.attack_sweeps import AttackSweep, SpatialRobustness
from robust_lightning.analysis.attention import RestrictedAttention
from robust_lightning.analysis.core import model_family
from robust_lightning.analysis.frequency import FrequencyNoise
from robust_lightning.analysis.kernels import KernelAttentionDistance
from robust_lightning.analysis.lesion import LesionStudy
from robust_lightning.analysis.occlusion import Occlusion
from robust_lightning.analysis.representation import FeatureVariance, FourierFeatures, LayerCorrelation
from robust_lightning.cli import main

ANALYSIS_CONFIGS = sorted((REPO / "configs" / "analysis").glob("*.yaml"))
# the model families each paper studies, as model_family names them
PAPERS = {
    "Bhojanapalli et al. 2021": {"ViT", "ResNet"},
    "Park & Kim 2022": {"ViT", "ResNet", "AlterNet"},
    "Chen et al. 2024": {"RepLKNet", "ConvNeXt", "ViT", "ResNet"},
}


def quickstart_arch(ckpt_path: str) -> str:
    """The architecture the quickstart config that writes ``ckpt_path`` trains."""
    for path in REPO.glob("configs/quickstart*.yaml"):
        config = yaml.safe_load(path.read_text())
        if ckpt_path.startswith(config.get("checkpoint", {}).get("dirpath", "//") + "/"):
            return config["model"]["arch"]
    raise AssertionError(f"no configs/quickstart*.yaml writes {ckpt_path}")


@pytest.mark.parametrize("path", ANALYSIS_CONFIGS, ids=lambda p: p.stem)
def test_every_analysis_config_names_its_figure_and_runs_on_the_papers_family(path):
    header = path.read_text().splitlines()[0]
    match = re.match(r"# (Bhojanapalli et al\. 2021|Park & Kim 2022|Chen et al\. 2024), (Figs?\.|Table) \d+", header)
    assert match, f"{path.name}: the first line names the paper and its figure: {header!r}"
    config = yaml.safe_load(path.read_text())
    family = model_family(quickstart_arch(config["ckpt_path"]))
    assert family in PAPERS[match.group(1)], f"{path.name} runs on a {family}, not a model of {match.group(1)}"
    if match.group(1).startswith("Bhojanapalli"):  # their preprocessing: the whole image resized, no crop
        assert config["data"].get("eval_resize") == "whole", f"{path.name} crops where Bhojanapalli et al. resize"


def figure_text(figure) -> list[dict]:
    """What a reader sees of each panel: its axis labels and legend entries."""
    panels = []
    for ax in figure.axes:
        legend = ax.get_legend()
        panels.append(
            {
                "x": ax.get_xlabel(),
                "y": ax.get_ylabel(),
                "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            }
        )
    return panels


def fit(tmp_path: Path, family: str) -> Path:
    """configs/quickstart_<family>.yaml as shipped, cut to two training steps on a small synthetic set."""
    config = yaml.safe_load((REPO / "configs" / f"quickstart_{family}.yaml").read_text())
    runs = tmp_path / "runs"
    config["trainer"] |= {
        "limit_train_batches": 2,
        "limit_val_batches": 1,
        "default_root_dir": str(runs / family),
        "enable_progress_bar": False,
    }
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(runs)
    config["checkpoint"]["dirpath"] = str(runs / family / "checkpoints")
    config["data"] |= {"batch_size": 8, "num_workers": 0}
    config["data"]["source"]["init_args"] |= {
        "train_per_class": 2,
        "val_per_class": 1,
        "root": str(tmp_path / "synthetic"),
    }
    path = tmp_path / f"{family}.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 0
    return runs / family / "checkpoints" / "last.ckpt"


def analyse(tmp_path: Path, name: str, ckpt: Path, **init_args) -> dict:
    """configs/analysis/<name>.yaml as shipped on ``ckpt``, 8 images; its results.json."""
    config = yaml.safe_load((REPO / "configs" / "analysis" / f"{name}.yaml").read_text())
    runs = tmp_path / "analyses"
    config["ckpt_path"] = str(ckpt)
    config["trainer"] |= {"default_root_dir": str(runs), "enable_progress_bar": False}
    config["trainer"]["logger"]["init_args"] |= {"save_dir": str(runs), "name": f"{name}-{ckpt.parents[1].name}"}
    config["trainer"]["callbacks"][0]["init_args"] |= {"max_images": 8, "batch_size": 8, **init_args}
    config["data"] |= {"eval_limit": 8, "eval_batch_size": 8, "num_workers": 0}
    config["data"]["source"]["init_args"] |= {
        "train_per_class": 2,
        "val_per_class": 1,
        "root": str(tmp_path / "synthetic"),
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["test", "--config", str(path)]) == 0
    run = max((runs / config["trainer"]["logger"]["init_args"]["name"]).glob("version_*"))
    results = json.loads((run / "results.json").read_text())
    section = results[
        config["trainer"]["callbacks"][0]["init_args"].get("name")
        or next(k for k in results if k not in ("test", "versions"))
    ]
    assert Path(section["plot"]).stat().st_size > 1000
    return section


def test_the_family_quickstarts_train_and_the_analyses_draw_the_papers_figures(tmp_path):
    checkpoints = {family: fit(tmp_path, family) for family in ("vit", "replknet", "convnext_lk", "alternet")}
    vit = "ViT (test_vit)"

    section = analyse(tmp_path, "lesion_bhojanapalli_fig8", checkpoints["vit"], random_counts=[2], samples=2)
    single, random = figure_text(LesionStudy.figure(section))
    assert (single["x"], single["y"]) == ("Removed block", "Accuracy (%)")
    assert single["legend"] == ["Block", "Self-Attention", "MLP", "Intact"]
    assert random["x"] == "Number of removed blocks"  # the bottom row: one curve per removed part, one run
    assert set(random["legend"]) == {
        f"{vit}, {part}: mean ± standard error" for part in ("Block", "Self-Attention", "MLP")
    } | {"Intact"}
    assert list(section["random"]) == ["block", "attention", "mlp"]
    assert section["random"]["mlp"]["2"]["removed"] == section["random"]["block"]["2"]["removed"]  # the same draws

    section = analyse(tmp_path, "lesion_chen_replknet", checkpoints["replknet"], samples=2)
    random = figure_text(LesionStudy.figure(section))[1]
    assert random["x"] == "Proportion of blocks dropped" and "RepLKNet (replknet_test)" in random["legend"]

    section = analyse(
        tmp_path,
        "restricted_attention_bhojanapalli",
        checkpoints["vit"],
        permutations=1,
        distances=[0, 1, float("inf")],
        cls_only=[1],
    )
    local, cls_only = figure_text(RestrictedAttention.figure(section))
    assert (local["x"], local["y"]) == ("Maximum distance (patches)", "Accuracy (%)")
    assert local["legend"] == [vit, f"{vit}, random permutation", "No restriction"]
    assert (cls_only["x"], cls_only["legend"]) == ("Number of blocks", ["Beginning", "End", "No restriction"])

    # a budget above the images there are (data.eval_limit 8): results.json records the 8 used beside the budget
    section = analyse(tmp_path, "layer_correlation_bhojanapalli", checkpoints["vit"], max_images=64)
    assert (section["conditions"]["images"], section["conditions"]["max_images"]) == (8, 64)
    panels = LayerCorrelation.figure(section).axes
    assert [ax.get_title() for ax in panels[:2]] == ["All tokens", "CLS token"]
    assert [ax.get_xlabel() for ax in panels[:2]] == ["Block", "Block"]

    section = analyse(tmp_path, "frequency_noise_parkkim_fig2b", checkpoints["vit"])
    (noise,) = figure_text(FrequencyNoise.figure(section))
    assert noise == {"x": "Noise frequency", "y": "Δ Accuracy (%)", "legend": [vit]}

    for family, label in (("vit", vit), ("alternet", "AlterNet (alternet_test)")):
        section = analyse(tmp_path, "fourier_features_parkkim", checkpoints[family])
        figure = FourierFeatures.figure(section)
        amplitude, over_depth = figure_text(figure)[:2]
        assert (amplitude["x"], amplitude["y"]) == ("Frequency", "Δ Log amplitude")
        assert (over_depth["x"], over_depth["y"]) == ("Normalized depth", "Δ Log amplitude")
        assert figure.axes[0].get_title() == label
        if family == "alternet":  # its MSA blocks are points of kind attention, shaded as the paper's gray areas
            assert any(p["kind"] == "attention" for p in section["points"])
            assert any(p["subsampling"] for p in section["points"])

    section = analyse(tmp_path, "feature_variance_parkkim", checkpoints["vit"])
    (variance,) = figure_text(FeatureVariance.figure(section))
    assert (variance["x"], variance["y"]) == ("Normalized depth", "Feature map variance")

    section = analyse(
        tmp_path,
        "occlusion_chen_fig4",
        checkpoints["replknet"],
        grid=4,
        samples=2,
        drop_fractions=[0.0, 0.5],
        lambdas=[0.5],
    )
    panels = figure_text(Occlusion.figure(section))
    assert [(p["x"], p["y"]) for p in panels] == [("Information loss ratio (%)", "Top-1 accuracy drop (%)")] * 3
    assert all(p["legend"] == ["RepLKNet (replknet_test)"] for p in panels)

    for family, label in (("replknet", "RepLKNet (replknet_test)"), ("convnext_lk", "ConvNeXt (convnext_lk_test)")):
        section = analyse(tmp_path, "kernel_distance_chen", checkpoints[family])
        figure = KernelAttentionDistance.figure(section)
        curves = figure_text(figure)[0]
        assert (curves["x"], curves["y"]) == ("Normalized channel index", "Kernel attention distance")
        assert curves["legend"][0] == "Stage 1, layer 1" and figure.axes[0].get_title() == label

    section = analyse(tmp_path, "pgd_sweep_chen", checkpoints["replknet"], steps=[1, 2], eps=[0.0, 0.004])
    radius, steps = figure_text(AttackSweep.figure(section))[:2]
    assert (radius["x"], radius["y"], radius["legend"]) == (
        "ε",
        "Accuracy (%)",
        ["RepLKNet (replknet_test), PGD-1", "RepLKNet (replknet_test), PGD-2"],
    )
    assert (steps["x"], steps["legend"]) == ("Attack steps", ["RepLKNet (replknet_test), ε = 0.004"])

    section = analyse(tmp_path, "spatial_attack", checkpoints["vit"], translations=3, rotations=3, max_images=4)
    bars = figure_text(SpatialRobustness.figure(section))[0]
    assert bars["y"] == "Accuracy (%)" and SpatialRobustness.figure(section).axes[0].get_title().startswith(vit)
