"""``robust-lightning claim``: RobustBench's model-info JSON for a leaderboard claim, from a results.json.

RobustBench's ImageNet Linf leaderboard evaluates standard AutoAttack at eps 4/255 on its 5000 val images
(data/robustbench_imagenet_test_image_ids.txt), resized to 256 and centre-cropped to 224. The claim is written
only for an evaluation that was exactly that; anything else is refused with every difference named. The JSON
has the fields of RobustBench's ``ModelInfo`` (robustbench/utils.py), accuracies as percent strings rounded to
two decimals as its ``update_json`` writes them; the fields only the authors know (link, name, authors, venue,
additional_data, reported) are left null to be filled in by hand. ``autoattack_acc`` is standard AutoAttack's
figure, the leaderboard's, whatever else ran. ``unreliable`` is true where a check of the reference AutoAttack was
raised (results.json's ``checks``), or where an adaptive attack broke images that standard AutoAttack had not: its
figure does not hold then. The adaptive attacks' figures and the lowest per image go into the footnote, since
RobustBench's ``ModelInfo`` takes no field beside its own. The sanity checks of Carlini et al. that were raised
are named in the footnote under their own name; they set nothing (they ask for adaptive attacks, which the
evaluation ran where it could).
"""

import json
import math
import sys
from pathlib import Path
from typing import Any

from robust_lightning.argument_parsing import run_tool
from robust_lightning.atomic import atomic_write_json
from robust_lightning.attacks.checks import REFERENCE_CHECKS
from robust_lightning.errors import UserError

EPS = 4 / 255
IMAGES = 5000
SUBSET = "robustbench"
IMAGE_SIZE = 224
PREPROCESSING = "resize 256 bicubic, center crop 224"  # RobustBench's BicubicRes256Crop224 (robustbench/data.py)
MANUAL_FIELDS = ("link", "name", "authors", "additional_data", "venue", "reported")


def _percent(value: float) -> str:
    return str(round(value * 100, 2))


def leaderboard_differences(results: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """How an evaluation differs from the leaderboard's, and its Linf 4/255 section (None when absent)."""
    threats = results.get("autoattack", {}).get("threat_models", {})
    linf = next((t for t in threats.values() if t.get("norm") == "Linf" and math.isclose(t.get("eps", 0), EPS)), None)
    if linf is None:
        return [f"no AutoAttack result in Linf at eps 4/255 (threat models: {', '.join(threats) or 'none'})"], None
    conditions = results["autoattack"].get("conditions", {})
    run = results.get("test") or results.get("fit") or {}
    data = run.get("conditions", {}).get("data") or {}
    checks = [
        (
            linf.get("num_points") == IMAGES,
            f"{linf.get('num_points')} images evaluated, not the leaderboard's {IMAGES}",
        ),
        (not linf.get("images_not_evaluated"), f"{linf.get('images_not_evaluated')} images were not evaluated"),
        (conditions.get("version") == "standard", f"AutoAttack version {conditions.get('version')!r}, not 'standard'"),
        (
            str(conditions.get("precision", "")).startswith("fp32"),
            f"AutoAttack precision {conditions.get('precision')!r}, not fp32",
        ),
        (
            sum(linf.get("claims_refuted_in_fp32_this_session", {}).values()) == 0,
            f"the fp32 check refuted {linf.get('claims_refuted_in_fp32_this_session')} attack successes",
        ),
        (
            data.get("imagenet_val") is True,  # the data module's word for it, whatever the source's class
            f"data source {data.get('source')!r} (split {data.get('eval_split')!r}), not ImageNet val"
            + (
                ""
                if "imagenet_val" in data
                else " as far as results.json says (written before conditions.data.imagenet_val): run the test "
                "again, AutoAttack resumes from its saved outcomes"
            ),
        ),
        (data.get("class_map", "imagenet") == "imagenet", f"class map {data.get('class_map')!r}, not 'imagenet'"),
        (
            data.get("eval_subset") == SUBSET,
            f"evaluation subset {data.get('eval_subset')!r}, not {SUBSET!r} (the leaderboard's 5000 images)",
        ),
        (data.get("eval_limit") is None, f"data.eval_limit {data.get('eval_limit')} cut the images"),
        (
            data.get("image_size") == IMAGE_SIZE and data.get("eval_preprocessing") == PREPROCESSING,
            f"preprocessing {data.get('eval_preprocessing')!r} at {data.get('image_size')} px, not {PREPROCESSING!r}",
        ),
    ]
    return [difference for holds, difference in checks if not holds], linf


def claim(results: str, *, model_name: str, architecture: str | None = None, out: str | None = None) -> int:
    """Write RobustBench's model-info JSON for the AutoAttack evaluation in ``results``.

    Args:
        results: a results.json (or the run directory holding it) of ``robust-lightning test`` with the AutoAttack
            callback or the card.
        model_name: RobustBench's name of the model, <Name><Year><FirstWordOfTheTitle>.
        architecture: as the leaderboard shows it (default: the architecture results.json records).
        out: where to write the JSON (default: model_info/imagenet/Linf/<model_name>.json, RobustBench's layout).
    """
    path = Path(results)
    path = path / "results.json" if path.is_dir() else path
    try:
        content = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read results {path}: {e}") from None
    differences, linf = leaderboard_differences(content)
    if differences:
        raise UserError(f"{path} is not an evaluation the leaderboard accepts:\n  " + "\n  ".join(differences))
    assert linf is not None  # no differences: the section is there
    conditions = content["autoattack"]["conditions"]
    model = (content.get("test") or content.get("fit") or {}).get("conditions", {}).get("model") or {}
    raised = [check for check, found in linf.get("checks", {}).items() if found.get("raised")]
    reference = [check for check in raised if check in REFERENCE_CHECKS]
    sanity = [check for check in raised if check not in REFERENCE_CHECKS]
    reported = linf.get("reported_robust_accuracy", linf["robust_accuracy"])
    info: dict[str, Any] = {field: None for field in MANUAL_FIELDS} | {
        "number_forward_passes": 1,
        "dataset": "imagenet",
        "architecture": architecture or model.get("arch"),
        "eps": "4/255",
        "clean_acc": _percent(linf["clean_accuracy"]),
        "autoattack_acc": _percent(linf["robust_accuracy"]),
        "footnote": f"Evaluated with robust-lightning: standard AutoAttack ({conditions.get('engine')} engine, "
        f"{conditions.get('precision')}, seed {conditions.get('seed')}) on RobustBench's {IMAGES} ImageNet "
        f"val images, {PREPROCESSING}; weights sha256 {conditions.get('weights_sha256')}.",
        # RobustBench's flag for an evaluation known not to hold: a check of the reference AutoAttack was raised,
        # or an adaptive attack broke images that standard AutoAttack had not
        "unreliable": bool(reference) or reported < linf["robust_accuracy"],
    }
    if linf.get("adaptive"):  # in the footnote: RobustBench's ModelInfo takes no other field
        each = ", ".join(f"{name} {_percent(f['robust_accuracy'])} %" for name, f in linf["adaptive"].items())
        info["footnote"] += f" Adaptive attacks: {each}; the lowest per image leaves {_percent(reported)} % robust."
    if reference:
        info["footnote"] += f" The reference AutoAttack's checks raised: {', '.join(reference)}."
    if sanity:
        info["footnote"] += f" The sanity checks of Carlini et al. raised: {', '.join(sanity)}."
    target = Path(out) if out else Path("model_info") / "imagenet" / "Linf" / f"{model_name}.json"
    atomic_write_json(target, info)
    print(
        f"wrote {target}: clean {info['clean_acc']} %, AutoAttack {info['autoattack_acc']} % (Linf 4/255, "
        f"{IMAGES} images); fill in by hand: {', '.join(MANUAL_FIELDS)}"
    )
    if reference:
        print(
            f"the reference AutoAttack's checks {', '.join(reference)} were raised: standard AutoAttack may not "
            "evaluate this model, so the claim is marked unreliable (results.json names what to run instead)"
        )
    if reported < linf["robust_accuracy"]:
        print(
            f"adaptive attacks broke images that standard AutoAttack had not ({_percent(reported)} % left): the "
            "claim is marked unreliable"
        )
    return 0


def claim_main(argv: list[str] | None = None) -> int:
    return run_tool(
        claim,
        sys.argv[1:] if argv is None else argv,
        prog="robust-lightning claim",
        description="Write RobustBench's model-info JSON for a leaderboard claim from the results.json of "
        "a standard AutoAttack evaluation (Linf 4/255, the 5000-image subset, 224 px), e.g.\n"
        "  robust-lightning claim runs/eval/autoattack/version_0 --model_name Me2026Robust",
    )
