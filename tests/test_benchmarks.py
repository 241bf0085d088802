"""Distribution-shift benchmarks: class lists, metrics against independent computations (numpy, scikit-learn),
layout errors, and one run through the CLI on tiny replicas of every layout."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from helpers import run_command
from robust_lightning.data.classes import class_map
from robust_lightning.errors import UserError
from robust_lightning.evaluation.benchmarks import (
    IN9_FOLDERS,
    SHIFT_BENCHMARKS,
    DistributionShiftBenchmarks,
    ShiftBenchmark,
    Split,
    accuracy,
    bg_gap,
    expected_calibration_error,
    full_split,
    imagenet_o_splits,
    in9_map,
    in9_splits,
    ood_metrics,
    predict,
    subset_classes,
    subset_split,
    top1_metrics,
)
from shift_data import WNIDS, benchmark_trees, shift_config, tree, write_favouring_checkpoint


# --------------------------------------------------------------------------------------------- class lists
@pytest.mark.parametrize("benchmark", ["imagenet_r", "imagenet_a", "imagenet_o"])
def test_the_200_class_indices_are_the_wnids_positions_among_the_1000(benchmark):
    wnids, indices = subset_classes(benchmark)
    imagenet = class_map("imagenet")
    assert len(set(wnids)) == 200 and list(indices) == [imagenet[w] for w in wnids]


def test_accuracy_of_sliced_logits_matches_a_hand_computation():
    _, indices = subset_classes("imagenet_r")
    logits = torch.zeros(4, 1000)
    logits[:, 0] = 100.0  # class 0 (tench) is not an ImageNet-R class: slicing must ignore it
    logits[0, indices[5]] = 3.0
    logits[1, indices[7]] = 3.0
    logits[2, indices[199]] = 3.0
    logits[3, indices[0]] = 3.0
    prediction, confidence = predict(logits, indices)
    assert prediction.tolist() == [5, 7, 199, 0]
    assert accuracy(prediction, torch.tensor([5, 7, 0, 1])) == 0.5  # two of four right
    expected = np.exp(3.0) / (np.exp(3.0) + 199)  # softmax over the 200 sliced logits only
    assert torch.allclose(confidence.double(), torch.full((4,), expected, dtype=torch.float64), atol=1e-6)
    full_prediction, _ = predict(logits)
    assert full_prediction.tolist() == [0, 0, 0, 0]


def numpy_ece(confidence: np.ndarray, correct: np.ndarray, bins: int = 15) -> float:
    edges = np.linspace(0, 1, bins + 1)
    ece = 0.0
    for lo, hi in itertools.pairwise(edges):
        inside = (confidence > lo) & (confidence <= hi)
        if inside.any():
            ece += inside.mean() * abs(correct[inside].mean() - confidence[inside].mean())
    return ece


def test_ece_matches_an_independent_numpy_computation():
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.05, 1.0, 500)
    correct = rng.uniform(size=500) < confidence**2  # miscalibrated on purpose
    ours = expected_calibration_error(torch.tensor(confidence), torch.tensor(correct))
    assert ours == pytest.approx(numpy_ece(confidence, correct.astype(float)), abs=1e-12)
    assert ours > 0.05
    # perfectly calibrated in each bin: all confidence 1 and all right
    assert expected_calibration_error(torch.ones(10), torch.ones(10, dtype=torch.bool)) == 0.0


def test_the_test_loop_calibration_metric_accumulates_batches_to_the_same_ece():
    from robust_lightning.evaluation.calibration import CalibrationError

    logits = torch.randn(300, 7, generator=torch.Generator().manual_seed(0)) * 3
    labels = torch.randint(0, 7, (300,), generator=torch.Generator().manual_seed(1))
    metric = CalibrationError()
    for part in range(3):  # batches (or ranks: the per-bin sums add up the same way)
        metric.update(logits[part * 100 : (part + 1) * 100], labels[part * 100 : (part + 1) * 100])
    confidence, prediction = logits.softmax(1).max(1)
    expected = numpy_ece(confidence.double().numpy(), (prediction == labels).double().numpy())
    assert metric.compute().item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ood_metrics_match_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    is_ood = rng.uniform(size=300) < 0.4
    scores = np.round(rng.normal(size=300) + is_ood, 1)  # rounded: many tied scores
    ours = ood_metrics(torch.tensor(scores), torch.tensor(is_ood))
    assert ours["aupr"] == pytest.approx(average_precision_score(is_ood, scores), abs=1e-12)
    assert ours["auroc"] == pytest.approx(roc_auc_score(is_ood, scores), abs=1e-12)
    assert ours["fpr95"] == pytest.approx(reference_fpr95(is_ood, scores), abs=1e-12)


def reference_fpr95(is_ood: np.ndarray, scores: np.ndarray) -> float:
    """FPR at the threshold hendrycks/natural-adv-examples' fpr_and_fdr_at_recall picks: of the thresholds up to
    the first with full recall, the one whose recall is closest to 95%; of tied ones the lowest threshold, as its
    search runs from the lowest threshold up."""
    fpr, tpr, _ = roc_curve(is_ood, scores, drop_intermediate=False)
    fpr, tpr = fpr[1:], tpr[1:]  # roc_curve starts at (0, 0), before any threshold
    full = int(np.argmax(tpr == tpr[-1]))
    best = min(reversed(range(full + 1)), key=lambda k: abs(tpr[k] - 0.95))  # min keeps the first of ties
    return float(fpr[best])


def test_fpr95_takes_the_recall_closest_to_95_percent_not_the_first_above_it():
    # 94 OOD first, then a tie of 5 OOD and 3 in-distribution, then 1 OOD and 97 in-distribution: recall jumps
    # from 0.94 (no false positive yet) to 0.99 (3 false positives); 0.94 is the closer one
    scores = np.concatenate([np.arange(200, 106, -1), np.zeros(8), -np.arange(1, 99)]).astype(float)
    is_ood = np.concatenate([np.ones(94), [1, 1, 1, 1, 1, 0, 0, 0], [1], np.zeros(97)]).astype(bool)
    assert is_ood.sum() == 100 and (~is_ood).sum() == 100
    assert ood_metrics(torch.tensor(scores), torch.tensor(is_ood))["fpr95"] == 0.0 == reference_fpr95(is_ood, scores)
    fpr, tpr, _ = roc_curve(is_ood, scores, drop_intermediate=False)
    assert fpr[np.searchsorted(tpr, 0.95)] == 0.03  # what the first threshold at or above 95% would give


def test_bg_gap_maps_the_1000_way_prediction_and_counts_unmapped_ones_wrong():
    mapping = in9_map()
    dogs = [i for i in range(1000) if mapping[i] == 0]
    birds = [i for i in range(1000) if mapping[i] == 1]
    unmapped = [i for i in range(1000) if mapping[i] == -1]
    assert len(unmapped) == 630 and mapping[0] == 8 and mapping[25] == -1  # tench: fish; 25 (salamander): none
    targets = torch.tensor([0, 0, 1, 1])
    same = accuracy(mapping[torch.tensor([dogs[0], dogs[5], birds[0], unmapped[3]])], targets)
    rand = accuracy(mapping[torch.tensor([dogs[1], birds[1], unmapped[0], unmapped[1]])], targets)
    assert (same, rand) == (0.75, 0.25)
    assert bg_gap({"original": 1.0, "mixed_same": same, "mixed_rand": rand}) == 0.5


# ---------------------------------------------------------------------------------------------- layouts


def test_layout_errors_name_the_expected_layout(tmp_path):
    r_wnids, _ = subset_classes("imagenet_r")
    a_wnids, _ = subset_classes("imagenet_a")
    with pytest.raises(UserError, match=r"does not exist; expected .*/<wnid>/<images>"):
        subset_split("imagenet_r", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no class folders; expected .*<wnid>"):
        subset_split("imagenet_r", tmp_path / "empty")
    wrong = next(w for w in a_wnids if w not in r_wnids)  # an ImageNet-A class that ImageNet-R lacks
    tree(tmp_path / "r", [r_wnids[0], wrong])
    with pytest.raises(UserError, match=rf"unknown class folders \['{wrong}'\]; expected .*imagenet_r_wnids.txt"):
        subset_split("imagenet_r", tmp_path / "r")
    tree(tmp_path / "sketch", ["n01440764", "cats"])
    with pytest.raises(UserError, match=r"unknown class folders \['cats'\]; expected .*wnid .* or all by class index"):
        full_split("imagenet_sketch", tmp_path / "sketch")
    tree(tmp_path / "v2", ["0", "1000"])
    with pytest.raises(UserError, match=r"unknown class folders \['1000'\]"):
        full_split("imagenet_v2", tmp_path / "v2")
    tree(tmp_path / "o", [subset_classes("imagenet_o")[0][0]])
    with pytest.raises(UserError, match="ImageNet-O needs imagenet_val"):
        imagenet_o_splits(tmp_path / "o", None)
    tree(tmp_path / "val", ["n01440764"])  # tench: not an ImageNet-O class
    with pytest.raises(UserError, match="no images of the 200 ImageNet-O classes"):
        imagenet_o_splits(tmp_path / "o", tmp_path / "val")
    for variant in ("original", "mixed_same"):
        tree(tmp_path / "in9" / variant / "val", IN9_FOLDERS[:2])
    missing_variant = r"mixed_rand/val does not exist; expected .*\{original,mixed_same,mixed_rand\}"
    with pytest.raises(UserError, match=missing_variant):
        in9_splits(tmp_path / "in9")
    tree(tmp_path / "in9" / "mixed_rand" / "val", ["dog"])
    with pytest.raises(UserError, match=r"unknown class folders \['dog'\]; expected .*'00_dog'"):
        in9_splits(tmp_path / "in9")


def test_layouts_read_labels_from_folder_names(tmp_path):
    r_wnids, _ = subset_classes("imagenet_r")
    split = subset_split("imagenet_r", tree(tmp_path / "r", [r_wnids[3], r_wnids[150]]))  # a partial copy is fine
    assert sorted({t for _, t in split.samples}) == [3, 150]
    v2 = full_split("imagenet_v2", tree(tmp_path / "v2", ["0", "999", "17"]))
    assert sorted({t for _, t in v2.samples}) == [0, 17, 999]
    sketch = full_split("imagenet_sketch", tree(tmp_path / "sketch", ["n01443537", "n15075141"]))
    assert sorted({t for _, t in sketch.samples}) == [1, 999]
    for variant in ("original", "mixed_same", "mixed_rand"):
        tree(tmp_path / "in9" / variant / "val", [IN9_FOLDERS[0], IN9_FOLDERS[8]])
    assert sorted({t for _, t in in9_splits(tmp_path / "in9")[2].samples}) == [0, 8]


# ----------------------------------------------------------------------------------------- through the CLI
# the first ImageNet-A class that ImageNet-R lacks: favouring it leaves ImageNet-R's predictions alone


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny untrained 1000-class classifier that favours one ImageNet-R and one ImageNet-A class."""
    return write_favouring_checkpoint(tmp_path_factory.mktemp("bench-ckpt") / "tiny.ckpt")


def bench_config(tmp_path: Path, roots: dict[str, str], devices: int = 1) -> Path:
    callback = {
        "class_path": "robust_lightning.evaluation.benchmarks.DistributionShiftBenchmarks",
        "init_args": {**roots, "batch_size": 4, "num_workers": 0},
    }
    return shift_config(tmp_path, "bench", [callback], devices)


def direct_metrics(checkpoint: Path, root: str, benchmark: str) -> tuple[float, float]:
    """ImageNet-R/-A top-1 and ECE computed without the callback or Lightning's loops."""
    from PIL import Image

    from robust_lightning.data.transforms import eval_transform
    from robust_lightning.training.lightning_module import ImageClassifier

    module = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    wnids, indices = subset_classes(benchmark)
    transform, correct, confidence = eval_transform(32), [], []
    for path in sorted(Path(root).glob("*/*.JPEG")):
        with torch.no_grad():
            probabilities = module(transform(Image.open(path))[None].float() / 255)[0, list(indices)].softmax(0)
        correct.append(int(probabilities.argmax()) == wnids.index(path.parent.name))
        confidence.append(float(probabilities.max()))
    return float(np.mean(correct)), numpy_ece(np.array(confidence), np.array(correct, dtype=float))


def direct_in9_metrics(checkpoint: Path, variant_root: Path) -> tuple[float, float]:
    """ImageNet-9 top-1 (1000-way argmax mapped to the 9 classes) and ECE (1000-way max softmax), directly."""
    from PIL import Image
    from torchvision.transforms import v2 as T

    from robust_lightning.training.lightning_module import ImageClassifier

    module = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    resize, to_in9 = T.Resize((32, 32), interpolation=T.InterpolationMode.BICUBIC), in9_map()
    correct, confidence = [], []
    for path in sorted(variant_root.glob("*/*.JPEG")):
        image = T.functional.pil_to_tensor(resize(Image.open(path).convert("RGB")))
        with torch.no_grad():
            probabilities = module(image[None].float() / 255)[0].softmax(0)
        correct.append(int(to_in9[probabilities.argmax()]) == IN9_FOLDERS.index(path.parent.name))
        confidence.append(float(probabilities.max()))
    return float(np.mean(correct)), numpy_ece(np.array(confidence), np.array(correct, dtype=float))


def test_cli_run_writes_every_benchmark_and_lists_the_skipped_one(tmp_path, checkpoint):
    from robust_lightning.cli import main

    roots = benchmark_trees(tmp_path)
    assert main(["test", "--config", str(bench_config(tmp_path, roots)), "--ckpt_path", str(checkpoint)]) == 0
    results_file = next((tmp_path / "runs" / "bench").glob("version_*/results.json"))
    results = json.loads(results_file.read_text())
    section = results["benchmarks"]
    assert "test" in results  # the model's own test set ran as usual

    skipped = {"benchmark": "imagenet_sketch", "reason": "no root given (init arg imagenet_sketch)"}
    assert section["skipped"] == [skipped]
    assert (section["imagenet_r"]["num_images"], section["imagenet_a"]["num_images"]) == (6, 4)
    assert section["imagenet_v2"]["num_images"] == 6 and section["imagenet_v2"]["num_classes"] == 1000
    for name in ("imagenet_r", "imagenet_a", "imagenet_v2"):
        assert 0 <= section[name]["acc1"] <= 1 and 0 <= section[name]["ece"] <= 1
        assert section[name]["preprocessing"] == "resize shorter side to 36 (bicubic), centre crop 32"
    # the favoured first class is right on its own folder's images only: 2 of 6 (R), 2 of 4 (A)
    assert (section["imagenet_r"]["acc1"], section["imagenet_a"]["acc1"]) == (1 / 3, 1 / 2)
    # RMS calibration error needs two bins of 100 images: reported, as None, for the 6 and 4 here
    assert section["imagenet_r"]["rms_calibration_error"] is None and "rms_calibration_error" in section["imagenet_a"]
    assert "rms_calibration_error" not in section["imagenet_v2"]
    for name in ("imagenet_r", "imagenet_a"):
        acc1, ece = direct_metrics(checkpoint, roots[name], name)
        assert section[name]["acc1"] == acc1 and section[name]["ece"] == pytest.approx(ece, abs=1e-6)

    o = section["imagenet_o"]
    assert (o["num_ood"], o["num_in_distribution"]) == (6, 4)  # tench's val images are not in-distribution
    assert all(0 <= o[k] <= 1 for k in ("aupr", "auroc", "fpr95"))
    in9 = section["imagenet_9"]
    assert set(in9["variants"]) == {"original", "mixed_same", "mixed_rand"}
    assert all(v["num_images"] == 6 for v in in9["variants"].values())
    assert in9["bg_gap"] == in9["variants"]["mixed_same"]["acc1"] - in9["variants"]["mixed_rand"]["acc1"]
    assert in9["preprocessing"] == "resize to 32 x 32 (bicubic)"
    for variant, values in in9["variants"].items():
        acc1, ece = direct_in9_metrics(checkpoint, tmp_path / "in9" / variant / "val")
        assert values["acc1"] == acc1 and values["ece"] == pytest.approx(ece, abs=1e-6)
    assert section["conditions"]["image_size"] == 32

    logged = (results_file.parent / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"benchmarks/imagenet_r/acc1", "benchmarks/imagenet_o/aupr", "benchmarks/imagenet_9/bg_gap"} <= set(logged)


def test_cli_fails_at_test_start_on_a_bad_root(tmp_path, checkpoint, capsys):
    from robust_lightning.cli import main

    roots = benchmark_trees(tmp_path)
    roots["imagenet_a"] = str(tmp_path / "missing")
    assert main(["test", "--config", str(bench_config(tmp_path, roots)), "--ckpt_path", str(checkpoint)]) == 2
    assert "missing does not exist; expected" in capsys.readouterr().err
    assert not list((tmp_path / "runs").glob("**/results.json"))  # failed before any work


def test_ddp_splits_every_benchmark_over_ranks_and_counts_each_image_once(tmp_path, checkpoint):
    roots = benchmark_trees(tmp_path)
    config = bench_config(tmp_path, roots, devices=2)
    result = run_command(["test", "--config", str(config), "--ckpt_path", str(checkpoint)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    section = json.loads(next((tmp_path / "runs" / "bench").glob("version_*/results.json")).read_text())["benchmarks"]
    assert (section["imagenet_r"]["num_images"], section["imagenet_a"]["num_images"]) == (6, 4)  # odd splits too
    assert (section["imagenet_o"]["num_ood"], section["imagenet_o"]["num_in_distribution"]) == (6, 4)
    assert all(v["num_images"] == 6 for v in section["imagenet_9"]["variants"].values())
    for name in ("imagenet_r", "imagenet_a"):
        acc1, ece = direct_metrics(checkpoint, roots[name], name)
        assert section[name]["acc1"] == acc1 and section[name]["ece"] == pytest.approx(ece, abs=1e-6)


def test_an_unreadable_image_is_skipped_and_named_not_fatal(tmp_path, checkpoint):
    from robust_lightning.cli import main

    roots = benchmark_trees(tmp_path)
    broken = next(Path(roots["imagenet_r"]).glob("*/*.JPEG"))
    broken.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    roots = {"imagenet_r": roots["imagenet_r"]}
    assert main(["test", "--config", str(bench_config(tmp_path, roots)), "--ckpt_path", str(checkpoint)]) == 0
    section = json.loads(next((tmp_path / "runs" / "bench").glob("version_*/results.json")).read_text())
    r = section["benchmarks"]["imagenet_r"]
    assert r["num_images"] == 5 and len(r["corrupt_images"]) == 1 and str(broken) in r["corrupt_images"][0]


# ------------------------------------------------------------------------------------ a registered benchmark
def toy_splits(root: str | Path) -> list[Split]:
    """A benchmark of three ImageNet classes (tench, goldfish, toilet tissue), folders named by wnid."""
    return [Split("toy_shift", [(str(p), WNIDS.index(p.parent.name)) for p in sorted(Path(root).glob("*/*.JPEG"))])]


TOY = ShiftBenchmark(
    "toy_shift", toy_splits, top1_metrics, keys=("acc1", "ece"), column="Toy", classes=lambda: (0, 1, 999)
)


def test_a_benchmark_registered_in_a_test_is_run_by_the_callback_the_card_and_evaluate(
    tmp_path, checkpoint, monkeypatch
):
    import robust_lightning
    from robust_lightning.cli import main

    monkeypatch.setitem(SHIFT_BENCHMARKS, "toy_shift", TOY)
    root = str(tree(tmp_path / "toy", WNIDS))  # two images of each of the three classes
    tree(tmp_path / "imagenet" / "val", WNIDS[:1])  # the model's own test set

    # the callback, from a config: the new benchmark's root under roots
    config = bench_config(tmp_path, {"roots": {"toy_shift": root}})
    assert main(["test", "--config", str(config), "--ckpt_path", str(checkpoint)]) == 0
    run = next((tmp_path / "runs" / "bench").glob("version_*"))
    section = json.loads((run / "results.json").read_text())["benchmarks"]
    assert section["toy_shift"]["num_images"] == 6 and section["toy_shift"]["num_classes"] == 3
    assert {s["benchmark"] for s in section["skipped"]} == set(SHIFT_BENCHMARKS) - {"toy_shift"}
    logged = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"benchmarks/toy_shift/acc1", "benchmarks/toy_shift/ece"} <= set(logged)

    # evaluate by its name, and the card: a model whose logits favour class 999 predicts it (position 2 of the
    # 3 classes) on every image, with the softmax over the 3 sliced logits as its confidence
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 1000))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.zero_()
        model[2].bias[999] = 5.0
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([999, 0])
    confidence = float(np.exp(5.0) / (np.exp(5.0) + 2))
    result = robust_lightning.evaluate(model, (x, y), ["toy_shift"], datasets={"toy_shift": root}, accelerator="cpu")
    toy = result["benchmarks"]["toy_shift"]
    assert toy["acc1"] == 1 / 3 and toy["ece"] == pytest.approx(confidence - 1 / 3, abs=1e-6)

    out = tmp_path / "card"
    result = robust_lightning.evaluate(
        model,
        (x, y),
        ["card"],
        datasets={"toy_shift": root},
        threat_models=[{"norm": "Linf", "eps": 4 / 255}],
        version="apgd-ce",
        n_iter=1,
        adaptive="none",  # the constant model raises AutoAttack's checks: no adaptive attacks here
        options={"resolution_sweep": None},
        out_dir=out,
        accelerator="cpu",
    )
    assert result["benchmarks"]["toy_shift"]["acc1"] == 1 / 3
    lines = (out / "robustness_card.md").read_text().splitlines()
    # its column in the distribution-shift row (top-1) and in the calibration table (ECE)
    tables = [table_of(lines, i) for i, line in enumerate(lines) if "| Toy |" in line]
    assert [t["Toy"] for t in tables] == ["33.33", f"{100 * (confidence - 1 / 3):.2f}"]


def table_of(lines: list[str], header: int) -> dict[str, str]:
    """The first row of the markdown table whose header is lines[header], by column."""
    cells = [[cell.strip() for cell in lines[i].strip("|").split("|")] for i in (header, header + 2)]
    return dict(zip(*cells, strict=True))


def test_roots_name_registered_benchmarks_once():
    with pytest.raises(UserError, match=r"roots: unknown \['imagenet_x'\]; the roots are imagenet_r, imagenet_a"):
        DistributionShiftBenchmarks(roots={"imagenet_x": "/x"})
    with pytest.raises(UserError, match=r"\['imagenet_r'\] given twice"):
        DistributionShiftBenchmarks(imagenet_r="/r", roots={"imagenet_r": "/r"})
    both = DistributionShiftBenchmarks(imagenet_r="/r", roots={"imagenet_a": "/a", "imagenet_val": "/val"})
    assert {k: v for k, v in both.roots.items() if v} == {
        "imagenet_r": "/r",
        "imagenet_a": "/a",
        "imagenet_val": "/val",
    }
