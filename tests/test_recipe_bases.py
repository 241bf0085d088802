"""Recipes that say only what differs: the bases of configs/recipes/base/, the ``extends`` key that composes a
config from them (robust_lightning.argument_parsing.compose_config), how little the recipes repeat each other, and the
run configs of the stem ablations of App. B (Tables 7-9) of Singh, Croce & Hein (NeurIPS 2023).

Every expected value of the App. B configs is written here from the paper, not read back from the files under test."""

import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from robust_lightning.argument_parsing import BASES_KEY, compose_config
from robust_lightning.cli import main
from robust_lightning.errors import UserError
from robust_lightning.models.convstem import (
    CONVNEXT_BASE_STEM_ABLATIONS,
    CONVNEXT_TINY_STEM_ABLATIONS,
    VIT_SMALL_STEM_ABLATIONS,
)

CONFIGS = REPO / "configs"
RECIPES = CONFIGS / "recipes"
BASES = RECIPES / "base"
STEMS = CONFIGS / "ablations" / "stems"
# the configs that extend bases: the recipes and their relatives (clean pre-training, Table 1, App. B)
COMPOSED = sorted(
    [*RECIPES.glob("*.yaml"), *(CONFIGS / "clean").glob("*.yaml"), *(CONFIGS / "ablations").rglob("*.yaml")]
)


def composed(path: Path) -> dict:
    return compose_config(path, yaml.safe_load(path.read_text()))


def print_config(path: Path, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------ repetition
def setting_lines(path: Path) -> list[str]:
    """The lines of a config that set something: not blank, not a comment, a trailing comment cut off."""
    lines = (re.sub(r"\s+#.*$", "", line).rstrip() for line in path.read_text().splitlines())
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def repeated_share(paths: list[Path]) -> float:
    """The share of the setting lines of ``paths`` that stand verbatim in another of them as well."""
    lines = {path: setting_lines(path) for path in paths}
    files_with = Counter(line for path_lines in lines.values() for line in set(path_lines))
    total = sum(len(path_lines) for path_lines in lines.values())
    return sum(files_with[line] > 1 for path_lines in lines.values() for line in path_lines) / total


def test_repeated_share_counts_lines_standing_in_another_file(tmp_path):
    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text("# header\nextends: base.yaml\nmodel.lr: 0.1\nmodel.arch: x   # a comment\n")
    b.write_text("extends: base.yaml\nmodel.arch: x\n\nmodel.lr: 0.2\n")
    c.write_text("model.lr: 0.3\n")
    assert repeated_share([a, b, c]) == pytest.approx(4 / 7)  # extends and model.arch, twice each


def test_the_recipes_repeat_each_other_in_at_most_30_percent_of_their_lines():
    """Issue 39: at most 30% of the recipes' non-comment lines stand in another recipe (92% before the bases)."""
    recipes = sorted(RECIPES.glob("*.yaml"))
    assert len(recipes) == 24
    assert repeated_share(recipes) <= 0.30


def test_every_recipe_starts_from_the_papers_base():
    def bases(path: Path) -> list[Path]:
        named = yaml.safe_load(path.read_text()).get(BASES_KEY, [])
        return [(path.parent / name).resolve() for name in ([named] if isinstance(named, str) else named)]

    def reaches_at(path: Path) -> bool:
        return any(base == BASES / "at.yaml" or reaches_at(base) for base in bases(path))

    for path in COMPOSED:
        assert reaches_at(path), path


@pytest.mark.parametrize("path", sorted(BASES.glob("*.yaml")), ids=lambda path: path.name)
def test_each_base_says_what_it_is(path):
    header = path.read_text().split("\n")
    assert header[0].startswith("# ") and len([line for line in header if line.startswith("#")]) >= 3


@pytest.mark.parametrize("path", COMPOSED, ids=lambda path: str(path.relative_to(CONFIGS)))
def test_each_config_keeps_its_header_and_its_command(path):
    text = path.read_text()
    assert text.startswith("# ") and "Singh" in " ".join(text.split("\n")[:2])  # the paper, first thing
    assert f"#   robust-lightning fit --config {path.relative_to(REPO)}" in text


# ------------------------------------------------------------------------------------------ composed configs
@pytest.mark.parametrize("path", COMPOSED, ids=lambda path: str(path.relative_to(CONFIGS)))
def test_composed_config_writes_its_run_directories_under_runs(path):
    """tests/test_documented_locations.py's check of the shipped run configs, on the composed config (the file
    itself names only what differs from its bases)."""
    trainer = composed(path)["trainer"]
    csv = trainer["logger"]
    assert csv["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    save_dir = Path(csv["init_args"]["save_dir"])
    assert save_dir.parts[0] == "runs"
    assert Path(trainer["default_root_dir"]) == save_dir / csv["init_args"]["name"]


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda path: path.name)
def test_composed_recipe_uses_the_official_fill_and_decode(path):
    """tests/test_augment.py's check of the recipes, on the composed recipe."""
    data = composed(path)["data"]
    assert data["augmentation_fill"] == "official" and data["full_resolution_decode"] is True


def test_print_config_shows_the_whole_composed_recipe(capsys):
    printed = print_config(RECIPES / "convnext_tiny_convstem_3step.yaml", capsys)
    assert BASES_KEY not in printed
    model, data = printed["model"], printed["data"]
    assert model["attack_steps"] == 3  # the recipe's own line
    assert model["arch"] == "convnext_tiny_convstem" and model["mean"] is None  # the recipe it extends, its mixin
    assert model["lr"] == 1e-3 and data["holdout"] == 4000 and printed["seed_everything"] == 0  # base/at.yaml
    logger = printed["trainer"]["logger"]["init_args"]  # the base's logger, the recipe's name merged into it
    assert (logger["save_dir"], logger["name"]) == ("runs/at", "convnext_tiny_convstem_3step")


# ------------------------------------------------------------------------------------------ compose_config
def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_file_without_bases_is_left_as_it_is(tmp_path):
    path = write(tmp_path / "plain.yaml", "model.lr: 0.1\nmodel:\n  arch: x\n")
    assert compose_config(path, yaml.safe_load(path.read_text())) == {"model.lr": 0.1, "model": {"arch": "x"}}


def test_bases_compose_in_order_relative_to_the_file_naming_them(tmp_path):
    write(
        tmp_path / "base" / "root.yaml",
        "trainer:\n  max_epochs: 300\n  logger:\n    class_path: a.CSVLogger\n    init_args: {save_dir: runs/at}\n"
        "model:\n  lr: 1.0e-3\n  betas: [0.9, 0.95]\n  mean: [0.5, 0.5, 0.5]\n",
    )
    write(tmp_path / "base" / "mixin.yaml", "model.mean: null\nmodel.lr: 2.0e-3\n")
    write(tmp_path / "parent.yaml", "extends: base/root.yaml\nmodel:\n  arch: p\n  betas: [0.8]\n")
    child = write(
        tmp_path / "sub" / "child.yaml",
        "extends: [../parent.yaml, ../base/mixin.yaml]\ntrainer.logger.init_args.name: c\nmodel.lr: 3.0e-3\n",
    )
    assert composed(child) == {
        "trainer": {
            "max_epochs": 300,
            "logger": {"class_path": "a.CSVLogger", "init_args": {"save_dir": "runs/at", "name": "c"}},
        },
        "model": {"lr": 3.0e-3, "betas": [0.8], "mean": None, "arch": "p"},  # a list replaces, never merges
    }


def test_a_mapping_naming_another_class_replaces_the_earlier_one(tmp_path):
    write(tmp_path / "base.yaml", "trainer:\n  logger:\n    class_path: a.CSVLogger\n    init_args: {save_dir: x}\n")
    path = write(tmp_path / "r.yaml", "extends: base.yaml\ntrainer.logger: {class_path: b.Other, init_args: {y: 1}}\n")
    assert composed(path) == {"trainer": {"logger": {"class_path": "b.Other", "init_args": {"y": 1}}}}


@pytest.mark.parametrize(
    "files,message",
    [
        ({"r.yaml": "extends: missing.yaml\n"}, "r.yaml: its base missing.yaml is not a file"),
        ({"r.yaml": "extends: a.yaml\n", "a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"}, "a cycle"),
        ({"r.yaml": "extends: r.yaml\n"}, "cycle: r.yaml -> r.yaml"),
        ({"r.yaml": "extends: a.yaml\n", "a.yaml": "model: [unclosed\n"}, "a.yaml, a base of"),
        ({"r.yaml": "extends: a.yaml\n", "a.yaml": "- a list\n"}, "holds no mapping of options"),
        ({"r.yaml": "extends: 3\n"}, "extends names a base config file or a list of them"),
        ({"r.yaml": "extends: []\n"}, "extends names a base config file or a list of them"),
    ],
    ids=["missing", "cycle", "itself", "invalid-yaml", "no-mapping", "not-a-name", "empty-list"],
)
def test_bad_bases_are_one_line_errors(tmp_path, capsys, files, message):
    for name, text in files.items():
        write(tmp_path / name, text)
    with pytest.raises(UserError, match=re.escape(message)):
        composed(tmp_path / "r.yaml")
    # the command reports it in one line, exit status 2, no traceback
    assert main(["fit", "--config", str(tmp_path / "r.yaml"), "--print_config"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_composed_config_parses_as_the_same_settings_in_one_file(tmp_path, capsys):
    base = "model:\n  arch: test_convnext\n  lr: 0.5\ntrainer:\n  max_epochs: 3\n  logger: false\n"
    write(tmp_path / "bases" / "b.yaml", base)
    child = write(tmp_path / "c.yaml", "extends: bases/b.yaml\nmodel.lr: 0.25\ntrainer:\n  max_epochs: 7\n")
    whole = write(tmp_path / "whole.yaml", base.replace("0.5", "0.25").replace("max_epochs: 3", "max_epochs: 7"))
    assert print_config(child, capsys) == print_config(whole, capsys)


def test_bases_compose_with_further_configs_and_options(tmp_path, capsys):
    write(tmp_path / "b.yaml", "model:\n  arch: test_convnext\n  lr: 0.5\n  min_lr: 0.01\n")
    child = write(tmp_path / "c.yaml", "extends: b.yaml\nmodel.lr: 0.25\n")
    later = write(tmp_path / "later.yaml", "model:\n  min_lr: 0.02\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(child), "--config", str(later), "--model.lr", "0.125", "--print_config"])
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["arch"], model["lr"], model["min_lr"]) == ("test_convnext", 0.125, 0.02)


# ------------------------------------------------------------------------------------------ App. B
# App. B, Tables 7-9: config -> (architecture, the Table 2 recipe it varies, the table's row, published clean / Linf /
# L2 / L1 accuracy). Table 8's P1 and C2 are the Table 2 recipes convnext_base.yaml and convnext_base_convstem.yaml.
APPENDIX_B = {
    "table7_convnext_tiny_patchstem": ("convnext_tiny", "convnext_tiny", "7", "Conv4,4, L", "71.0 46.5 38.1 14.9"),
    "table7_convnext_tiny_stem_c7s4": (
        "convnext_tiny_stem_c7s4",
        "convnext_tiny",
        "7",
        "Conv7,4, L, G",
        "69.8 46.6 38.4 17.6",
    ),
    "table7_convnext_tiny_stem_c7s4_c3s1": (
        "convnext_tiny_stem_c7s4_c3s1",
        "convnext_tiny",
        "7",
        "Conv7,4, L, G, Conv3,1, L, G",
        "67.5 43.6 37.9 15.7",
    ),
    "table7_convnext_tiny_stem_c7s2_c3s2": (
        "convnext_tiny_stem_c7s2_c3s2",
        "convnext_tiny",
        "7",
        "Conv7,2, L, G, Conv3,2, L, G",
        "69.6 47.6 38.8 18.7",
    ),
    "table7_convnext_tiny_stem_c5s2_c3s2": (
        "convnext_tiny_stem_c5s2_c3s2",
        "convnext_tiny",
        "7",
        "Conv5,2, L, G, Conv3,2, L, G",
        "70.2 47.4 44.2 21.2",
    ),
    "table7_convnext_tiny_convstem": (
        "convnext_tiny_convstem",
        "convnext_tiny",
        "7",
        "Conv3,2, L, G, Conv3,2, L, G",
        "69.5 46.2 47.8 27.7",
    ),
    "table8_convnext_base_stem_c1": (
        "convnext_base_stem_c1",
        "convnext_base",
        "8",
        "C1: N*-2N*",
        "75.2 54.2 48.9 24.0",
    ),
    "table9_vit_small_patchstem": ("vit_small_patch16_224", "vit_small", "9", "P1: PatchStem", "65.1 39.2 37.4 16.5"),
    "table9_vit_small_convstem": (
        "vit_small_patch16_224_convstem",
        "vit_small",
        "9",
        "C1: N*-2N*-4N*-8N*",
        "68.0 43.3 46.3 27.0",
    ),
    "table9_vit_small_stem_c2": (
        "vit_small_patch16_224_stem_c2",
        "vit_small",
        "9",
        "C2: N*-N*-N*-8N*",
        "64.8 41.1 45.3 28.3",
    ),
    "table9_vit_small_stem_c3": (
        "vit_small_patch16_224_stem_c3",
        "vit_small",
        "9",
        "C3: N**-8N**",
        "64.5 40.3 46.2 32.3",
    ),
    "table9_vit_small_stem_c4": (
        "vit_small_patch16_224_stem_c4",
        "vit_small",
        "9",
        "C4: N**-2N*-4N*-8N",
        "64.7 40.4 46.4 32.6",
    ),
    "table9_vit_small_stem_c5": (
        "vit_small_patch16_224_stem_c5",
        "vit_small",
        "9",
        "C5: N**-2N**-4N-8N",
        "64.6 39.3 45.8 33.2",
    ),
}


def test_every_app_b_stem_ablation_has_a_run_config():
    assert {p.stem for p in STEMS.glob("*.yaml")} == set(APPENDIX_B)
    registered = {*CONVNEXT_TINY_STEM_ABLATIONS, *CONVNEXT_BASE_STEM_ABLATIONS, *VIT_SMALL_STEM_ABLATIONS}
    assert registered <= {arch for arch, *_ in APPENDIX_B.values()}


@pytest.mark.parametrize("name", sorted(APPENDIX_B))
def test_app_b_config_is_its_table_row(name, capsys):
    """App. B: the non-stem part warm-started from the ImageNet-1k PatchStem weights, the stem random; otherwise the
    architecture's Table 2 recipe (heavy augmentation), for 50 epochs; the header gives the row and its numbers."""
    arch, recipe, table, row, numbers = APPENDIX_B[name]
    path = STEMS / f"{name}.yaml"
    config = print_config(path, capsys)
    base = print_config(RECIPES / f"{recipe}.yaml", capsys)
    model = config["model"]
    assert model["arch"] == arch and config["trainer"]["max_epochs"] == 50 and model["warmup_epochs"] is None
    assert model["init_from"] == base["model"]["init_from"] and model["init_from"].startswith("weights/")
    for key in ("mean", "std", "lr", "attack", "attack_eps", "attack_steps", "ema_decay", "select_attack_steps"):
        assert model[key] == base["model"][key], key
    assert config["data"] == base["data"] and config["data"]["augmentation"] == "heavy"
    assert config["checkpoint"]["dirpath"] == f"runs/appendix_b/{name}" == config["trainer"]["default_root_dir"]
    header = " ".join(line.removeprefix("# ") for line in path.read_text().splitlines() if line.startswith("# "))
    assert header.startswith(f'Singh et al. 2023, Table {table}, row "{row}"')
    clean, linf, l2, l1 = numbers.split()
    assert f"clean {clean}, Linf 4/255 {linf}, L2 2 {l2}, L1 75 {l1}" in header
