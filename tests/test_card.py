"""The robustness card: one command runs every evaluation and renders one markdown card from results.json."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO
from robust_lightning.cli import main
from robust_lightning.errors import UserError
from robust_lightning.evaluation.card import RobustnessCard, paper_rows, percent, render_card
from shift_data import benchmark_trees, imagenet_c_tree, imagenet_p_tree, shift_config, write_favouring_checkpoint

# n_queries: the budget of Square from scratch, which a raised check calls for
QUICK_ATTACK = {"version": "apgd-ce", "n_iter": 3, "n_queries": 20}


@pytest.fixture(scope="module")
def imagenet_checkpoint(tmp_path_factory) -> Path:
    """A tiny untrained 1000-class classifier that favours one ImageNet-R and one ImageNet-A class."""
    return write_favouring_checkpoint(tmp_path_factory.mktemp("card-ckpt") / "tiny.ckpt")


def test_render_card_lays_out_our_numbers_beside_the_papers():
    results = {
        "autoattack": {
            "threat_models": {
                "Linf-4_255": {
                    "norm": "Linf",
                    "eps": 4 / 255,
                    "num_points": 50,
                    "clean_accuracy": 0.76,
                    "robust_accuracy": 0.56,
                },
                "L2-2": {"norm": "L2", "eps": 2.0, "num_points": 50, "clean_accuracy": 0.76, "robust_accuracy": 0.4},
            },
            "conditions": {"version": "standard", "precision": "fp32"},
        },
        "benchmarks": {
            "imagenet_r": {"acc1": 0.5, "ece": 0.1},
            "skipped": [{"benchmark": "imagenet_a", "reason": "no root"}],
        },
        "imagenet_c": {
            "mce_partial": {"value": 0.61},
            "mean_acc1": 0.45,
            "corruptions": {"fog": {"mean_error": 0.5, "ce": 0.6, "ece": 0.2}},
        },
        "resolution_sweep": {
            "resolutions": {
                "224": {
                    "resolution": 224,
                    "num_images": 50,
                    "clean_accuracy": 0.7,
                    "threat_models": {"Linf-4_255": {"norm": "Linf", "eps": 4 / 255, "robust_accuracy": 0.5}},
                },
                "256": {
                    "resolution": 256,
                    "num_images": 50,
                    "clean_accuracy": 0.72,
                    "threat_models": {"Linf-4_255": {"norm": "Linf", "eps": 4 / 255, "robust_accuracy": 0.52}},
                },
            },
            "best": {"by_robust": {"resolution": 256}},
            "conditions": {"attack": "apgd-t"},
        },
    }
    header = {"arch": "convnext_base_convstem", "checkpoint": "x.ckpt", "resolution": 224, "data": {}}
    papers = paper_rows("convnext_base_convstem")
    # Table 2's 50-epoch, 250-epoch and 250-epoch 3-step rows, and Table 3's best test resolution
    assert [(p["resolution"], p["note"]) for p in papers] == [
        ("224", "50 epochs"),
        ("224", "250 epochs"),
        ("224", "250 epochs, 3 steps"),
        ("256", "best test resolution, 250 epochs"),
    ]
    skipped = [{"benchmark": "imagenet_p", "reason": "no dataset root given"}]
    card = render_card(header, {"test/acc1": 0.75, "test/ece": 0.03}, results, skipped, papers)
    lines = card.splitlines()
    assert "| this checkpoint (224 px) | 76.00 | 56.00 | 40.00 |" in lines
    # the published L2 2 number beside ours; a paper row without one keeps an empty cell
    assert "| ConvNeXt-B + ConvStem, Singh et al. 2023 (224 px, 250 epochs) | 75.90 | 56.14 | 49.12 |" in lines
    assert (
        "| ConvNeXt-B + ConvStem, Singh et al. 2023 (256 px, best test resolution, 250 epochs) | 76.9 | 57.3 | - |"
        in lines
    )
    assert any(line.startswith("| this checkpoint | 75.00 | 61.00 (partial) | 45.00 | 50.00 | - |") for line in lines)
    assert "| **256** | 50 | 72.00 | 52.00 |" in lines and "| 224 | 50 | 70.00 | 50.00 |" in lines
    assert "| resolution | images | clean | Linf 4/255 (apgd-t) |" in lines
    # a model of other classes: no mCE against AlexNet's ImageNet errors
    other = render_card(header | {"num_classes": 10}, {}, results, [], [])
    assert "- (not ImageNet)" in other and "61.00" not in other
    assert "- imagenet_p: no dataset root given" in lines and "- imagenet_a: no root" in lines
    assert render_card(header | {"arch": "resnet18"}, {}, results, [], paper_rows("resnet18")).count("Singh") == 0
    assert "checks raised" not in card  # none recorded, none shown

    # a check of the reference AutoAttack raised: its section comes before the numbers it qualifies
    linf = results["autoattack"]["threat_models"]["Linf-4_255"]
    linf["checks"] = {
        "randomized": {"raised": True, "figures": {}, "advice": "use version='rand'"},
        "dynamic": {"raised": False, "figures": {}, "advice": ""},
    }
    lines = render_card(header, {}, results, [], []).splitlines()
    heading = lines.index("## Checks raised: standard AutoAttack's robust accuracy below may not hold")
    assert lines[
        heading + 2
    ] == "- Linf-4_255: `randomized` (the reference AutoAttack): use version='rand'" and "dynamic" not in "".join(lines)
    assert heading < next(i for i, line in enumerate(lines) if line.startswith("## Adversarial robustness"))


def test_bad_settings_fail_at_start_naming_the_part():
    with pytest.raises(UserError, match="unknown \\['imagenet_x'\\]"):
        RobustnessCard(datasets={"imagenet_x": "/x"})
    with pytest.raises(UserError, match="RobustnessCard.resolution_sweep: .*resolution"):
        RobustnessCard(resolution_sweep={"resolution": [224]})


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_card_runs_every_benchmark_that_has_data(tmp_path, imagenet_checkpoint):
    roots = benchmark_trees(tmp_path)
    roots["imagenet_c"] = str(imagenet_c_tree(tmp_path / "imagenet_c"))
    imagenet_p_tree(tmp_path / "imagenet_p")
    roots["imagenet_p"] = str(tmp_path / "imagenet_p")
    roots.pop("imagenet_val")  # the card finds <data.root>/val itself
    for image in (tmp_path / "imagenet" / "val").glob("*/*"):  # unique file names, as in ImageNet val
        image.rename(image.with_name(f"{image.parent.name}_{image.name}"))
    quick = {"batch_size": 4, "num_workers": 0}
    card_callback = {
        "class_path": "robust_lightning.evaluation.card.RobustnessCard",
        "init_args": {
            "datasets": roots,
            "autoattack": {
                **QUICK_ATTACK,
                "threat_models": [{"norm": "Linf", "eps": 4 / 255}, {"norm": "L2", "eps": 0.3}],
            },
            "benchmarks": quick,
            "imagenet_p": {
                "batch_size": 2,
                "num_workers": 0,
                "perturbations": ["brightness", "gaussian_noise"],
            },
            "imagenet_c": {**quick, "corruptions": ["gaussian_noise", "brightness"], "clean_error": 0.5},
            "resolution_sweep": {"resolutions": [32, 48], "attack": "apgd-ce", "n_iter": 2},
        },
    }
    path = shift_config(tmp_path, "card", [card_callback], enable_progress_bar=False, inference_mode=False)
    assert main(["test", "--config", str(path), "--ckpt_path", str(imagenet_checkpoint)]) == 0
    run = tmp_path / "runs" / "card" / "version_0"
    results = _load(run / "results.json")
    assert {"autoattack", "benchmarks", "imagenet_c", "imagenet_p", "resolution_sweep", "card", "test"} <= set(results)
    card = (run / "robustness_card.md").read_text()
    bench = results["benchmarks"]
    shift_row = next(line for line in card.splitlines() if line.startswith("| this checkpoint |"))
    for value in (
        bench["imagenet_r"]["acc1"],
        bench["imagenet_a"]["acc1"],
        bench["imagenet_v2"]["acc1"],
        bench["imagenet_o"]["aupr"],
        bench["imagenet_9"]["bg_gap"],
        results["imagenet_c"]["mean_acc1"],
    ):
        assert f" {percent(value)} " in shift_row
    linf = results["autoattack"]["threat_models"]["Linf-4_255"]
    assert linf["num_points"] == 6 and f"| {percent(linf['robust_accuracy'])} |" in card
    assert "- imagenet_sketch: no root given (init arg imagenet_sketch)" in card  # no data: listed, not dropped
    for plot in ("imagenet_c_errors.png", "imagenet_p.png", "resolution_sweep.png"):
        assert f"]({plot})" in card and (run / plot).is_file()
    assert results["card"]["parts"] == ["autoattack", "benchmarks", "imagenet_c", "imagenet_p", "resolution_sweep"]


def test_the_quickstart_card_config_on_a_quickstart_model(tmp_path):
    """configs/eval/quickstart_card.yaml as shipped, on a quickstart-shaped (10 synthetic classes, 32 px) model."""
    from lightning import Trainer

    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(arch="test_resnet", num_classes=10, image_size=32)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "quick.ckpt")

    config = yaml.safe_load((REPO / "configs" / "eval" / "quickstart_card.yaml").read_text())
    config["ckpt_path"] = str(tmp_path / "quick.ckpt")
    config["trainer"] |= {"default_root_dir": str(tmp_path / "runs"), "enable_progress_bar": False}
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    card_args = config["trainer"]["callbacks"][0]["init_args"]
    card_args["autoattack"] |= QUICK_ATTACK
    card_args["imagenet_c"] |= {"corruptions": ["gaussian_noise", "contrast"], "severities": [1, 5], "num_workers": 0}
    card_args["resolution_sweep"] |= {"resolutions": [24, 32], "attack": "apgd-ce", "n_iter": 3}
    config["data"] |= {"eval_limit": 8, "num_workers": 0}
    config["data"]["source"]["init_args"] |= {
        "train_per_class": 2,
        "val_per_class": 2,
        "root": str(tmp_path / "synthetic"),
    }
    path = tmp_path / "quickstart_card.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["test", "--config", str(path)]) == 0
    run = tmp_path / "runs" / "quickstart_card" / "version_0"
    results, card = _load(run / "results.json"), (run / "robustness_card.md").read_text()
    assert results["card"]["parts"] == ["autoattack", "imagenet_c", "resolution_sweep"]
    assert {t["num_points"] for t in results["autoattack"]["threat_models"].values()} == {8}
    assert set(results["imagenet_c"]["corruptions"]) == {"gaussian_noise", "contrast"}
    assert "- imagenet_r: the model has 10 classes; this benchmark is labelled with ImageNet's 1000" in card
    assert "| L2 0.286 | L1 1.53 |" in card  # radii quoted as the papers do
    assert "## Test resolution" in card and "## Adversarial robustness" in card


def test_the_card_shows_mt5d_unnormalised_and_mfr_in_percent():
    results = {"imagenet_p": {"mfr": 0.1234, "mt5d": 1.8765}}
    card = render_card({"arch": "resnet18", "checkpoint": "x.ckpt", "resolution": 224, "data": {}}, {}, results, [], [])
    header = next(line for line in card.splitlines() if "IN-P mFR" in line)
    row = card.splitlines()[card.splitlines().index(header) + 2]
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["IN-P mFR ↓"] == "12.34"  # a rate, in %
    assert cells["IN-P mT5D (unnormalised) ↓"] == "1.877"  # a distance, as measured


def test_published_numbers_are_found_by_threat_model_and_an_unpublished_radius_is_said():
    def card_of(*threats: tuple[str, float]) -> list[str]:
        sections = {
            f"t{i}": {"norm": norm, "eps": eps, "num_points": 50, "clean_accuracy": 0.7, "robust_accuracy": 0.5}
            for i, (norm, eps) in enumerate(threats)
        }
        results = {"autoattack": {"threat_models": sections, "conditions": {}}}
        header = {"arch": "vit_small_patch16_224", "checkpoint": "x.ckpt", "resolution": 224, "data": {}}
        return render_card(header, {}, results, [], paper_rows("vit_small_patch16_224")).splitlines()

    paper = "| ViT-S, Singh et al. 2023 (224 px, 300 epochs) | 69.22 |"
    # 4/255 in float32 and 2.0 given as an integer are the papers' radii: their numbers stand beside ours
    lines = card_of(("Linf", float(torch.tensor(4 / 255, dtype=torch.float32))), ("L2", 2))
    assert f"{paper} 44.04 | 37.52 |" in lines
    assert not any(line.startswith("No published numbers") for line in lines)
    # a radius near but not at 4/255, and one the papers do not report: said, not a silent "-"
    lines = card_of(("Linf", 0.0157), ("L1", 75.0), ("L2", 0.3))
    assert f"{paper} - | 15.12 | - |" in lines
    assert "No published numbers at Linf 4.0035/255, L2 0.3: the papers report Linf 4/255, L2 2, L1 75." in lines
