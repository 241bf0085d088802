"""The paper's recipes (configs/recipes, configs/clean) against Singh, Croce & Hein (NeurIPS 2023), the paper's
warm-up rule, the official code's weight-decay rule and the published numbers (data/paper_results.csv, README).

Every expected value is written here from the paper (Table 2, Table 4, Table 6, Table 10, App. A, App. D.6),
not read back from the files under test."""

import csv
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from helpers import REPO
from robust_lightning.cli import main
from robust_lightning.training.lightning_module import ImageClassifier, paper_warmup_epochs
from robust_lightning.training.schedule import warmup_cosine

RECIPES = REPO / "configs" / "recipes"
CLEAN = REPO / "configs" / "clean"

# Table 2, "ours" rows: recipe -> (arch, epochs, AT steps, effective batch (App. A.3), peak-lr epoch (App. A.1),
# selection steps (App. A.1 / A.3), published clean / Linf 4/255 / L2 2 / L1 75)
TABLE2 = {
    "vit_small": ("vit_small_patch16_224", 300, 2, 1392, 20, 1, ("69.22", "44.04", "37.52", "15.12")),
    "convnext_iso_small": ("convnext_iso_small", 300, 2, 1392, 20, 1, ("69.04", "44.22", "36.64", "14.88")),
    "convnext_iso_small_convstem": (
        "convnext_iso_small_convstem",
        300,
        2,
        1392,
        20,
        1,
        ("70.02", "45.90", "49.24", "27.84"),
    ),
    "vit_small_convstem": ("vit_small_patch16_224_convstem", 300, 2, 1392, 20, 1, ("72.56", "48.08", "50.40", "26.68")),
    "convnext_tiny": ("convnext_tiny", 300, 2, 1392, 20, 1, ("72.40", "48.60", "38.02", "14.88")),
    "convnext_tiny_convstem": ("convnext_tiny_convstem", 300, 2, 1392, 20, 1, ("72.72", "49.46", "48.42", "24.52")),
    "convnext_tiny_convstem_3step": (
        "convnext_tiny_convstem",
        300,
        3,
        1392,
        20,
        1,
        ("72.70", "50.16", "49.00", "24.16"),
    ),
    "vit_medium": ("deit3_medium_patch16_224", 50, 2, 1024, 10, 10, ("71.72", "47.24", "49.02", "29.20")),
    "vit_medium_convstem": (
        "vit_medium_patch16_224_convstem",
        50,
        2,
        1024,
        10,
        10,
        ("72.40", "48.80", "50.56", "28.12"),
    ),
    "convnext_small": ("convnext_small", 50, 2, 1024, 10, 10, ("74.10", "52.32", "43.84", "19.52")),
    "convnext_small_convstem": ("convnext_small_convstem", 50, 2, 1024, 10, 10, ("74.10", "52.42", "50.88", "25.64")),
    "vit_base": ("vit_base_patch16_224", 50, 2, 864, 10, 10, ("73.32", "50.02", "52.14", "33.12")),
    "vit_base_convstem": ("vit_base_patch16_224_convstem", 50, 2, 864, 10, 10, ("74.38", "52.58", "54.38", "31.20")),
    "convnext_base": ("convnext_base", 50, 2, 756, 10, 10, ("75.62", "54.34", "48.52", "23.70")),
    "convnext_base_convstem": ("convnext_base_convstem", 50, 2, 756, 10, 10, ("75.32", "54.38", "50.06", "24.76")),
    "vit_base_convstem_250ep": (
        "vit_base_patch16_224_convstem",
        250,
        2,
        864,
        20,
        10,
        ("76.30", "54.66", "56.30", "32.06"),
    ),
    "convnext_base_convstem_250ep": (
        "convnext_base_convstem",
        250,
        2,
        756,
        20,
        10,
        ("75.90", "56.14", "49.12", "23.34"),
    ),
    "convnext_base_convstem_250ep_3step": (
        "convnext_base_convstem",
        250,
        3,
        756,
        20,
        10,
        ("75.18", "56.28", "49.40", "23.60"),
    ),
}
# ConvStem clean pre-training (App. A, Table 10): config -> (arch, epochs; 100 small, 50 medium and large)
CLEAN_TABLE10 = {
    "convnext_tiny_convstem": ("convnext_tiny_convstem", 100),
    "convnext_iso_small_convstem": ("convnext_iso_small_convstem", 100),
    "vit_small_convstem": ("vit_small_patch16_224_convstem", 100),
    "vit_medium_convstem": ("vit_medium_patch16_224_convstem", 50),
    "convnext_small_convstem": ("convnext_small_convstem", 50),
    "vit_base_convstem": ("vit_base_patch16_224_convstem", 50),
    "convnext_base_convstem": ("convnext_base_convstem", 50),
}
# Table 4 / App. A.5: fine-tune -> (architecture, the Table 2 recipe it starts from, batch, published numbers)
FINETUNES = {
    "finetune_eps8": ("convnext_base_convstem", "convnext_base_convstem", 756, "clean 71.7, Linf 8/255 33.2"),
    "finetune_eps8_vit_small_convstem": (
        "vit_small_patch16_224_convstem",
        "vit_small_convstem",
        1392,
        "clean 67.5, Linf 8/255 28.2",
    ),
    "finetune_eps8_convnext_tiny_convstem": (
        "convnext_tiny_convstem",
        "convnext_tiny_convstem",
        1392,
        "clean 68.6, Linf 8/255 29.6",
    ),
}
# App. D.6 (the first of its two "CIFAR-100" settings read as CIFAR-10): dataset -> (AT steps, peak lr, weight
# decay, batch, resolution, stride-1 stem)
TRANSFER = {
    "flowers102": (2, 4e-3, 5e-3, 30, 224, False),
    "cifar10": (10, 2e-4, 0.0, 1024, 32, True),
    "cifar100": (10, 2e-4, 5e-3, 256, 32, True),
}


def print_config(path: Path, *overrides: str, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), *overrides, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_every_recipe_is_a_table2_row_or_a_fine_tuning_of_app_d6():
    expected = set(TABLE2) | set(FINETUNES) | {f"transfer_{name}" for name in TRANSFER}
    assert {p.stem for p in RECIPES.glob("*.yaml")} == expected
    assert {p.stem for p in CLEAN.glob("*.yaml")} == set(CLEAN_TABLE10)


def test_paper_warmup_rule():
    # App. A: peak lr at epoch 10 for 50 or 100 epochs, at epoch 20 for 250 or 300
    assert [paper_warmup_epochs(e) for e in (1, 25, 50, 100, 101, 250, 300)] == [10, 10, 10, 10, 20, 20, 20]


@pytest.mark.parametrize("name", sorted(TABLE2))
def test_table2_recipe(name, capsys):
    arch, epochs, steps, batch, warmup, select, _ = TABLE2[name]
    config = print_config(RECIPES / f"{name}.yaml", capsys=capsys)
    model, data, checkpoint = config["model"], config["data"], config["checkpoint"]
    assert model["arch"] == arch and config["trainer"]["max_epochs"] == epochs
    assert model["attack"] == "apgd" and model["attack_norm"] == "Linf"
    assert model["attack_eps"] == pytest.approx(4 / 255)
    assert model["attack_steps"] == steps and not model["attack_random_start"]
    assert data["global_batch_size"] == batch and data["augmentation"] == "heavy" and data["holdout"] == 4000
    # the warm-up is left to the paper's rule, so overriding trainer.max_epochs keeps it
    assert model["warmup_epochs"] is None and paper_warmup_epochs(epochs) == warmup
    assert model["lr"] == 1e-3 and model["min_lr"] == 5e-6 and model["betas"] == [0.9, 0.95]
    assert model["weight_decay"] == 0.05 and model["weight_decay_rule"] == "official"
    assert model["label_smoothing"] == 0.1 and model["ema_decay"] == 0.9999
    assert model["select_attack_steps"] == select and checkpoint["monitor"] == "val/select_acc"
    assert (checkpoint["dirpath"], checkpoint["filename"]) == (f"runs/at/{name}", "best")
    if arch.endswith("_convstem"):  # warm start from the best clean ConvStem checkpoint
        clean = name.split("_convstem")[0] + "_convstem"
        assert model["init_from"] == f"runs/clean/{clean}/best.ckpt"
        assert model["init_from"] in (RECIPES / f"{name}.yaml").read_text().split("seed_everything")[0]  # header
    else:
        assert model["init_from"].startswith("weights/")


IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.mark.parametrize("name", sorted(TABLE2) + sorted(FINETUNES))
def test_recipe_follows_the_official_runs(name, capsys):
    """What the official code (github.com/nmndeep/revisiting-at) did, written here from it: main.py puts an
    ImageNet mean/std normaliser in front of every architecture by default (add_normalization=1), which its one
    script, a ConvStem run, turns off (run_train.sh); the released ViT-S + ConvStem keeps one. It saves every
    epoch; its EMA decay is 0.9999, the decay of Sec. 4.2."""
    path = RECIPES / f"{name}.yaml"
    config = print_config(path, capsys=capsys)
    model, data = config["model"], config["data"]
    header = path.read_text().split("seed_everything")[0]
    if "_convstem" not in model["arch"] or model["arch"].startswith("vit_small_patch16_224"):
        assert (model["mean"], model["std"]) == (IMAGENET_MEAN, IMAGENET_STD)
        assert "add_normalization" in header or "normaliser" in header
    else:
        assert model["mean"] is None and model["std"] is None
    # the checkpoints are read as EMA weights later (sweeps, fine-tunes): selected on them
    assert model["select_on"] == "ema"
    # the paper's per-GPU batch of 8 A100-40GB caps one forward pass; fewer GPUs accumulate
    assert data["max_device_batch_size"] == -(-data["global_batch_size"] // 8)
    assert "Sec. 4.1" not in header and "saved every\n#     2 epochs" not in header
    assert "Sec. 4.2" in header or name in FINETUNES  # which name their 4/255 recipe's differences
    assert f"Loader workers: {data['num_workers']} per GPU" in header


@pytest.mark.parametrize("name", sorted(CLEAN_TABLE10))
def test_clean_convstem_config_uses_the_official_pipeline(name, capsys):
    data = print_config(CLEAN / f"{name}.yaml", capsys=capsys)["data"]
    # the official clean training builds the same transform as its AT runs (no dependence on the attack)
    assert data["augmentation_fill"] == "official" and data["full_resolution_decode"]
    assert data["max_device_batch_size"] == -(-data["global_batch_size"] // 8)


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_cifar_crop_scale_is_said_to_be_ours(dataset):
    header = (RECIPES / f"transfer_{dataset}.yaml").read_text().split("seed_everything")[0]
    assert "data.crop_scale [0.35, 1]: ours" in header


def test_overriding_max_epochs_keeps_the_paper_warmup(capsys):
    config = print_config(RECIPES / "convnext_tiny.yaml", "--trainer.max_epochs", "50", capsys=capsys)
    assert config["trainer"]["max_epochs"] == 50 and config["model"]["warmup_epochs"] is None


@pytest.mark.parametrize("name", sorted(CLEAN_TABLE10))
def test_clean_convstem_config(name, capsys):
    arch, epochs = CLEAN_TABLE10[name]
    config = print_config(CLEAN / f"{name}.yaml", capsys=capsys)
    model, checkpoint = config["model"], config["checkpoint"]
    assert model["arch"] == arch and config["trainer"]["max_epochs"] == epochs and model["attack"] == "none"
    assert model["warmup_epochs"] is None and paper_warmup_epochs(epochs) == 10
    assert config["data"]["augmentation"] == "heavy" and model["weight_decay_rule"] == "official"
    # the best clean accuracy, kept under the fixed path the AT recipes start from
    assert checkpoint["monitor"] == "val/acc1" and checkpoint["mode"] == "max"
    assert (checkpoint["dirpath"], checkpoint["filename"]) == (f"runs/clean/{name}", "best")
    assert not checkpoint["enable_version_counter"]
    assert model["init_from"].startswith("weights/")


@pytest.mark.parametrize("name", sorted(FINETUNES))
def test_finetune_eps8_is_app_a5(name, capsys):
    """Table 4's three fine-tunes to 8/255 (App. A.5): from the Table 2 model of the same architecture, 25 epochs,
    peak lr 1e-4 at epoch 5, 2-step APGD-AT at 8/255, that model's batch; the header gives Table 4's numbers."""
    arch, start, batch, published = FINETUNES[name]
    config = print_config(RECIPES / f"{name}.yaml", capsys=capsys)
    model = config["model"]
    assert model["arch"] == arch and model["init_from"] == f"runs/at/{start}/best.ckpt" and model["init_from_ema"]
    assert config["trainer"]["max_epochs"] == 25 and model["lr"] == 1e-4 and model["warmup_epochs"] == 5
    assert model["attack_eps"] == pytest.approx(8 / 255) and model["attack_steps"] == 2
    assert config["data"]["global_batch_size"] == batch and config["data"]["augmentation"] == "heavy"
    assert config["checkpoint"]["dirpath"] == f"runs/finetune_eps8/{start}"
    assert published in (RECIPES / f"{name}.yaml").read_text().split("seed_everything")[0]


@pytest.mark.parametrize("dataset", sorted(TRANSFER))
def test_transfer_recipe_is_app_d6(dataset, capsys):
    steps, lr, weight_decay, batch, size, small_input = TRANSFER[dataset]
    path = RECIPES / f"transfer_{dataset}.yaml"
    config = print_config(path, capsys=capsys)
    model, data = config["model"], config["data"]
    assert model["arch"] == "convnext_base_convstem" and model["new_head"] and model["small_input"] == small_input
    assert model["init_from"] == "runs/finetune_eps8/convnext_base_convstem/best.ckpt"
    assert model["attack"] == "apgd" and model["attack_steps"] == steps
    assert model["attack_eps"] == pytest.approx(8 / 255)
    assert config["trainer"]["max_epochs"] == 20 and model["warmup_epochs"] == 2
    assert model["lr"] == lr and model["weight_decay"] == weight_decay and data["global_batch_size"] == batch
    assert data["image_size"] == size and data["source"]["class_path"].endswith("FolderSource")
    assert config["checkpoint"]["monitor"] is None  # no selection on the test split
    assert "App. D.6" in path.read_text()


# ------------------------------------------------------------------------------------------ schedule
def lr_factors(module: ImageClassifier, max_epochs: int, steps_per_epoch: int = 10) -> list[float]:
    module._trainer = SimpleNamespace(estimated_stepping_batches=max_epochs * steps_per_epoch, max_epochs=max_epochs)
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    return [scheduler.lr_lambdas[0](step) for step in range(max_epochs * steps_per_epoch)]


@pytest.mark.parametrize(
    "max_epochs,warmup_epochs,expected_warmup",
    [(300, None, 20), (50, None, 10), (250, None, 20), (300, 5, 5), (50, 0.5, 0.5)],
)
def test_warmup_follows_the_paper_unless_set(max_epochs, warmup_epochs, expected_warmup):
    module = ImageClassifier(arch="test_convnext", num_classes=4, lr=1e-3, min_lr=5e-6, warmup_epochs=warmup_epochs)
    total = max_epochs * 10
    expected = [warmup_cosine(s, total, round(expected_warmup * 10), 1.0, 5e-3) for s in range(total)]
    assert lr_factors(module, max_epochs) == pytest.approx(expected)


# ------------------------------------------------------------------------------------------ weight decay
def decayed(arch: str, rule: str) -> tuple[set[str], set[str]]:
    """(decayed, all) parameter names of the optimiser configure_optimizers builds."""
    module = ImageClassifier(arch=arch, num_classes=1000, weight_decay=0.05, weight_decay_rule=rule)
    module._trainer = SimpleNamespace(estimated_stepping_batches=10, max_epochs=1)
    optimizer = module.configure_optimizers()["optimizer"]
    names = {id(p): name for name, p in module.model.net.named_parameters()}
    chosen = {
        names[id(p)] for group in optimizer.param_groups if group["weight_decay"] == 0.05 for p in group["params"]
    }
    assert all(group["weight_decay"] in (0.0, 0.05) for group in optimizer.param_groups)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(names)
    return chosen, set(names.values())


def matching(pattern: str, names: set[str]) -> set[str]:
    return {n for n in names if re.fullmatch(pattern, n)}


def test_weight_decay_rules_on_convnext_tiny():
    timm_rule, names = decayed("convnext_tiny", "timm")
    official, _ = decayed("convnext_tiny", "official")
    # convolution and linear weights: stem conv, 3 downsampling convs, 18 blocks x (dw conv, fc1, fc2), head
    weights = matching(
        r"(stem\.0|stages\.[123]\.downsample\.1|stages\.\d\.blocks\.\d+\.(conv_dw|mlp\.fc1|mlp\.fc2)"
        r"|head\.fc)\.weight",
        names,
    )
    assert len(weights) == 1 + 3 + 18 * 3 + 1
    assert timm_rule == weights
    # the official code spares only biases: LayerNorm weights (stem, downsampling, blocks, head) and gamma too
    norms_and_scales = matching(
        r"(stem\.1|stages\.[123]\.downsample\.0|stages\.\d\.blocks\.\d+\.norm|head\.norm)"
        r"\.weight|stages\.\d\.blocks\.\d+\.gamma",
        names,
    )
    assert len(norms_and_scales) == 1 + 3 + 18 + 18 + 1
    assert official == weights | norms_and_scales
    assert official == {n for n in names if not n.endswith(".bias")}


def test_weight_decay_rules_on_vit_small():
    timm_rule, names = decayed("vit_small_patch16_224", "timm")
    official, _ = decayed("vit_small_patch16_224", "official")
    weights = matching(
        r"patch_embed\.proj\.weight|blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.weight"
        r"|head\.weight",
        names,
    )
    assert len(weights) == 1 + 12 * 4 + 1
    assert timm_rule == weights
    # the official code decays the position embedding and the class token as well (not 1-D, not biases)
    assert official == weights | {"pos_embed", "cls_token"}


# ------------------------------------------------------------------------------------------ published numbers
def test_paper_results_csv_has_every_table2_row_with_its_four_numbers():
    with open(REPO / "data" / "paper_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    ours = {Path(row["recipe"]).stem: row for row in rows if row["recipe"]}
    assert set(ours) == set(TABLE2)
    for name, (arch, epochs, steps, *_, numbers) in TABLE2.items():
        row = ours[name]
        setting = (row["arch"], int(row["epochs"]), int(row["adv_steps"]), row["resolution"])
        assert setting == (arch, epochs, steps, "224")
        assert (row["clean"], row["autoattack_linf_4_255"], row["autoattack_l2_2"], row["autoattack_l1_75"]) == numbers
    # the other models of Table 2, each with its source
    others = [row for row in rows if row["paper"] != "Singh et al. 2023"]
    assert len(others) == 18 and all("Table 2" in row["citation"] for row in others)
    xcit_s = next(row for row in others if row["model"] == "XCiT-S12")
    published = tuple(xcit_s[k] for k in ("clean", "autoattack_linf_4_255", "autoattack_l2_2", "autoattack_l1_75"))
    assert published == ("72.34", "41.78", "46.20", "22.72")


@pytest.mark.parametrize("page", ["README.md", "docs/training.md"])
def test_the_docs_list_every_recipe_with_its_published_numbers(page):
    text = (REPO / page).read_text()
    for name, (*_, numbers) in TABLE2.items():
        line = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert line is not None, name
        assert " / ".join(numbers) in line, line
    assert "not available offline" not in text


# Table 1's basic-augmentation rows (App. A.2): row -> recipe -> the published clean, Linf, L2, L1 accuracies
TABLE1 = {
    "random_basic": (
        '"random init., basic augment."',
        {
            "convnext_tiny": ("64.0", "37.1", "28.9", "8.8"),
            "convnext_tiny_convstem": ("64.2", "37.6", "40.2", "18.6"),
            "convnext_iso_small": ("60.5", "31.7", "20.8", "4.0"),
            "convnext_iso_small_convstem": ("62.1", "33.5", "40.0", "23.8"),
            "vit_small": ("61.5", "31.8", "35.5", "15.1"),
            "vit_small_convstem": ("62.8", "34.4", "39.2", "20.4"),
        },
    ),
    "pretrained_basic": (
        '"+ strong clean pre-training"',
        {
            "convnext_tiny": ("69.4", "41.6", "42.4", "18.9"),
            "convnext_tiny_convstem": ("69.1", "42.2", "42.4", "19.7"),
            "convnext_iso_small": ("68.0", "38.9", "38.3", "17.0"),
            "convnext_iso_small_convstem": ("69.5", "41.8", "46.2", "26.9"),
            "vit_small": ("66.8", "39.1", "34.5", "12.6"),
            "vit_small_convstem": ("71.2", "44.3", "47.1", "23.2"),
        },
    ),
}
ABLATIONS = REPO / "configs" / "ablations"


def test_every_ablation_config_is_a_table1_row():
    assert {p.stem for p in ABLATIONS.glob("*.yaml")} == {
        f"table1_{name}_{row}" for row, (_, rows) in TABLE1.items() for name in rows
    }


@pytest.mark.parametrize("row,name", [(row, name) for row, (_, rows) in TABLE1.items() for name in sorted(rows)])
def test_table1_basic_augmentation_rows(row, name, capsys):
    """App. A.2's first two Table 1 rows: 50 epochs with the crop alone, from random weights or from the Table 2
    recipe's pre-trained ones; no label smoothing, as the official code's plain cross-entropy without mixing, and no
    EMA, which the paper adds with the heavy augmentations; the rest as the architecture's Table 2 recipe."""
    label, rows = TABLE1[row]
    path = ABLATIONS / f"table1_{name}_{row}.yaml"
    config = print_config(path, capsys=capsys)
    recipe = print_config(RECIPES / f"{name}.yaml", capsys=capsys)
    model, data = config["model"], config["data"]
    assert model["init_from"] == (None if row == "random_basic" else recipe["model"]["init_from"])
    assert data["augmentation"] == "basic" and config["trainer"]["max_epochs"] == 50
    assert model["label_smoothing"] == 0.0 and model["ema_decay"] is None and model["select_on"] == "raw"
    assert model["warmup_epochs"] is None and paper_warmup_epochs(50) == 10
    for key in ("arch", "mean", "std", "attack", "attack_eps", "attack_steps", "lr", "weight_decay", "betas"):
        assert model[key] == recipe["model"][key], key
    assert data["global_batch_size"] == recipe["data"]["global_batch_size"]
    assert config["checkpoint"]["dirpath"] == f"runs/table1/{name}_{row}"
    lines = path.read_text().split("seed_everything")[0].splitlines()
    header = " ".join(line.removeprefix("# ") for line in lines)
    clean, linf, l2, l1 = rows[name]
    assert lines[0].startswith(f"# Singh et al. 2023, Table 1, row {label}")
    assert f"clean {clean}, Linf 4/255 {linf}, L2 {l2}, L1 {l1}" in header
