"""The robustness card: ``robust-lightning test --config configs/eval/card.yaml --ckpt_path CKPT``.

One callback runs every evaluation of the project on one checkpoint, with every dataset root given once
(``datasets``): AutoAttack in the three threat models on the test set, the distribution-shift benchmarks
(ImageNet-R, -A, -Sketch, -V2, -O, -9), ImageNet-C (released, or generated from the test images), ImageNet-P
and the resolution sweep. Each part is the project's own callback, built here and driven through the same
hooks; each writes its section of results.json as usual. At the end the card renders those sections into
``robustness_card.md`` beside results.json: tables laid out like the papers' (with the published numbers
beside ours when the architecture is one of theirs, data/paper_results.csv), the plots, and the list of
everything that was skipped and why (no dataset root, or a model whose classes are not ImageNet's 1000).
"""

import csv
import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from robust_lightning.atomic import atomic_write_text
from robust_lightning.attacks.checks import REFERENCE_CHECKS
from robust_lightning.data.contract import evaluation_data
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import AutoAttackEvaluation, ThreatModel
from robust_lightning.evaluation.base import Evaluation, evaluation_resolution, evaluation_source
from robust_lightning.evaluation.benchmarks import SHIFT_BENCHMARKS, DistributionShiftBenchmarks, shift_datasets
from robust_lightning.evaluation.evaluated_module import model_setting
from robust_lightning.evaluation.imagenet_c import ImageNetC
from robust_lightning.evaluation.imagenet_p import ImageNetP
from robust_lightning.evaluation.resolution import ResolutionSweep
from robust_lightning.evaluation.results import ResultsFile
from robust_lightning.models.robustbench import is_robustbench_arch, robustbench_entry
from robust_lightning.paths import DATA_DIR


def card_datasets() -> list[str]:
    """The card's dataset roots: ImageNet-C and -P, and those of the distribution-shift benchmarks registered."""
    return ["imagenet_c", "imagenet_p", *shift_datasets()]


def imagenet_labelled() -> list[str]:
    """The benchmarks labelled with ImageNet-1k classes, which need a 1000-class model: ImageNet-C and -P, and
    every distribution-shift benchmark (each reads the 1000 logits, or a subset of them)."""
    return ["imagenet_c", "imagenet_p", *SHIFT_BENCHMARKS]


CARD_FILE = "robustness_card.md"


def paper_rows(arch: str) -> list[dict[str, str]]:
    """Published results for this architecture (data/paper_results.csv), any resolution. For
    ``robustbench:<name>`` first the leaderboard's numbers of those very weights, then the papers' for its
    architecture."""
    rows = []
    if is_robustbench_arch(arch):
        entry = robustbench_entry(arch)
        rows.append(
            {
                "paper": "RobustBench leaderboard",
                "model": entry.name,
                "arch": arch,
                "resolution": str(entry.preprocessing.image_size),
                "clean": f"{entry.clean_acc:.2f}",
                PUBLISHED_AUTOATTACK[("Linf", Fraction(4, 255))]: f"{entry.autoattack_acc:.2f}",  # its only radius
                "note": "these weights",
                "source": "data/robustbench_imagenet_linf.csv",
            }
        )
        arch = entry.timm_arch
    with open(DATA_DIR / "paper_results.csv", newline="") as f:
        return rows + [row for row in csv.DictReader(f) if row["arch"] == arch]


class RobustnessCard(Evaluation):
    """Every evaluation on one checkpoint, and one card (see the module docstring).

    Args:
        datasets: dataset roots, set once: imagenet_c (the released folder, or "generated" to corrupt the test
            images on the fly), imagenet_p, imagenet_r, imagenet_a, imagenet_sketch, imagenet_v2, imagenet_o,
            imagenet_val (in-distribution images of ImageNet-O; default ``<data.source.root>/val`` for a folder
            dataset) and imagenet_9. A missing or null root skips that benchmark (listed in the card).
        autoattack: settings of the AutoAttack part (AutoAttackEvaluation's arguments; default: standard
            AutoAttack, Linf 4/255, L2 2.0 and L1 75, fp32). None: no AutoAttack.
        benchmarks, imagenet_c, imagenet_p: settings of those parts (batch_size, num_workers, image_size, ...).
        resolution_sweep: settings of the resolution sweep (ResolutionSweep's arguments). None: no sweep.
        paper_results: show the published numbers of data/paper_results.csv for the model's architecture.
    """

    name = "card"

    def __init__(
        self,
        datasets: dict[str, str | None] | None = None,
        autoattack: dict[str, Any] | None = {},  # noqa: B006 - a default --print_config shows; read, never mutated
        benchmarks: dict[str, Any] | None = None,
        imagenet_c: dict[str, Any] | None = None,
        imagenet_p: dict[str, Any] | None = None,
        resolution_sweep: dict[str, Any] | None = {},  # noqa: B006 - a default --print_config shows; read, never mutated
        paper_results: bool = True,
    ):
        datasets = dict(datasets or {})
        known = card_datasets()
        unknown = sorted(set(datasets) - set(known))
        if unknown:
            raise UserError(f"RobustnessCard.datasets: unknown {unknown}; the datasets are {', '.join(known)}")
        self.datasets = {name: datasets.get(name) for name in known}
        self.settings: dict[str, Any] = {  # the options of each part (None: not requested)
            "autoattack": autoattack,
            "benchmarks": benchmarks or {},
            "imagenet_c": imagenet_c or {},
            "imagenet_p": imagenet_p or {},
            "resolution_sweep": resolution_sweep,
        }
        self.paper_results = paper_results
        self.parts: dict[str, Evaluation] = {}
        self.skipped: list[dict[str, str]] = []
        self._build_parts(num_classes=1000)  # wrong settings fail here, at start-up

    # ------------------------------------------------------------------------------------------- parts
    def _part(self, name: str, cls, **kwargs: Any) -> Evaluation:
        try:
            part: Evaluation = cls(**kwargs)
            return part
        except TypeError as e:  # an unknown or missing setting: name the part, not a frame deep inside
            raise UserError(f"RobustnessCard.{name}: {e}") from None

    def _build_parts(self, num_classes: int, imagenet_val: str | None = None) -> None:
        roots, settings = self.datasets, self.settings
        self.parts, self.skipped = {}, []

        def skip(name: str, reason: str) -> None:
            self.skipped.append({"benchmark": name, "reason": reason})

        if settings["autoattack"] is not None:
            self.parts["autoattack"] = self._part("autoattack", AutoAttackEvaluation, **settings["autoattack"])
        else:
            skip("autoattack", "not requested (autoattack: null)")
        if num_classes != 1000:
            # generated ImageNet-C corrupts the test set itself, whatever its labels: it still applies
            foreign = [
                name for name in imagenet_labelled() if not (name == "imagenet_c" and roots[name] == "generated")
            ]
            for name in foreign:
                skip(name, f"the model has {num_classes} classes; this benchmark is labelled with ImageNet's 1000")
            roots = {name: None if name in foreign else root for name, root in roots.items()}
        if any(roots[name] for name in SHIFT_BENCHMARKS):
            shifts = {name: roots[name] for name in shift_datasets()}
            if "imagenet_val" in shifts:  # ImageNet-O's in-distribution images: the data's val folder unless given
                shifts["imagenet_val"] = shifts["imagenet_val"] or imagenet_val
            self.parts["benchmarks"] = self._part(
                "benchmarks", DistributionShiftBenchmarks, roots=shifts, **settings["benchmarks"]
            )
        elif num_classes == 1000:
            names = list(SHIFT_BENCHMARKS)  # "imagenet_r, _a, _sketch, ...": short, as the card has always listed them
            short = [names[0], *(name.replace("imagenet", "", 1) for name in names[1:])]
            skip(f"distribution shifts ({', '.join(short)})", "no dataset root given")
        if roots["imagenet_c"] == "generated":
            self.parts["imagenet_c"] = self._part("imagenet_c", ImageNetC, source="generated", **settings["imagenet_c"])
        elif roots["imagenet_c"]:
            self.parts["imagenet_c"] = self._part(
                "imagenet_c", ImageNetC, root=roots["imagenet_c"], **settings["imagenet_c"]
            )
        elif num_classes == 1000:
            skip("imagenet_c", "no dataset root given (a folder, or 'generated')")
        if roots["imagenet_p"]:
            self.parts["imagenet_p"] = self._part(
                "imagenet_p", ImageNetP, root=roots["imagenet_p"], **settings["imagenet_p"]
            )
        elif num_classes == 1000:
            skip("imagenet_p", "no dataset root given")
        if settings["resolution_sweep"] is not None:
            self.parts["resolution_sweep"] = self._part(
                "resolution_sweep", ResolutionSweep, **settings["resolution_sweep"]
            )
        else:
            skip("resolution_sweep", "not requested (resolution_sweep: null)")

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "test":
            raise UserError("RobustnessCard runs under `robust-lightning test` only")
        num_classes = int(model_setting(pl_module, "num_classes", 1000))
        source = evaluation_source(trainer)
        default_val = None
        if source is not None and source.val_folder is not None and Path(source.val_folder).is_dir():
            default_val = source.val_folder
        self._build_parts(num_classes, default_val)
        if source is not None and not source.own_preprocessing:  # robust_lightning.evaluate on images in memory
            for name in ("resolution_sweep", "imagenet_c"):
                if name in self.parts and not (name == "imagenet_c" and self.datasets["imagenet_c"] != "generated"):
                    del self.parts[name]
                    self.skipped.append(
                        {
                            "benchmark": name,
                            "reason": "the images were given as tensors, which it cannot read at a preprocessing of "
                            "its own: give evaluate an ImageNet val root as data",
                        }
                    )
        for part in self.parts.values():
            part.setup(trainer, pl_module, stage)

    def _forward(hook: str):  # type: ignore[misc]  # called in the class body (below), to make the hooks
        def forward(self, trainer, pl_module, *args: Any, **kwargs: Any) -> None:
            for part in self.parts.values():
                getattr(part, hook)(trainer, pl_module, *args, **kwargs)

        forward.__name__ = hook
        return forward

    on_test_start = _forward("on_test_start")
    on_test_batch_end = _forward("on_test_batch_end")
    on_test_epoch_end = _forward("on_test_epoch_end")
    teardown = _forward("teardown")
    on_exception = _forward("on_exception")  # a stop or an error: the parts free their outcome folders
    del _forward

    def on_test_end(self, trainer, pl_module) -> None:
        for part in self.parts.values():
            part.on_test_end(trainer, pl_module)
        run_dir = self.run_dir(trainer)  # a collective under DDP: all ranks call it
        if not trainer.is_global_zero:
            self.publish(trainer, None, None)
            return
        results = ResultsFile.of(run_dir).sections  # what the parts handed the writer, in memory
        test_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test")}
        header = {
            "arch": model_setting(pl_module, "arch", type(pl_module).__name__),
            "num_classes": int(model_setting(pl_module, "num_classes", 1000)),
            "checkpoint": trainer.ckpt_path,
            "resolution": evaluation_resolution(trainer, pl_module, None),
            "data": data.conditions() if (data := evaluation_data(trainer)) is not None else None,
        }
        papers = paper_rows(header["arch"]) if self.paper_results else []
        atomic_write_text(run_dir / CARD_FILE, render_card(header, test_metrics, results, self.skipped, papers))
        columns, row = summary_row(test_metrics, results, header["num_classes"] == 1000)
        self.publish(
            trainer,
            {"markdown": str((run_dir / CARD_FILE).resolve()), "parts": list(self.parts), "skipped": self.skipped},
            None,
            tables={"summary": (columns, [row])},
            message=f"robustness card: {(run_dir / CARD_FILE).resolve()}",
        )


# ------------------------------------------------------------------------------------------------ rendering
def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def plain(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def mean_over(section: dict[str, Any], key: str, shown: Callable[[float | None], str] = percent) -> str:
    """A benchmark mean (mCE, mFR, ...), marked partial when the section has it over a subset only."""
    if section.get(key) is not None:
        return shown(section[key])
    partial = (section.get(f"{key}_partial") or {}).get("value")
    return "-" if partial is None else f"{shown(partial)} (partial)"


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


# The threat models of the published AutoAttack numbers (the radii of Singh et al.'s Table 2; RobustBench's Linf
# leaderboard at 4/255), as norm and exact radius, and their columns in data/paper_results.csv
PUBLISHED_AUTOATTACK = {
    ("Linf", Fraction(4, 255)): "autoattack_linf_4_255",
    ("L2", Fraction(2)): "autoattack_l2_2",
    ("L1", Fraction(75)): "autoattack_l1_75",
}


def published_column(norm: str, eps: float) -> str | None:
    """The column of the published numbers at this threat model; None where the papers report none. A radius
    matches to a relative 1e-6, so that 4/255 as a float64 or float32 number is 4/255, and 0.0157 is not."""
    return next(
        (
            column
            for (published_norm, radius), column in PUBLISHED_AUTOATTACK.items()
            if norm == published_norm and math.isclose(eps, radius, rel_tol=1e-6)
        ),
        None,
    )


def threat_label(section: dict[str, Any]) -> str:
    """ "Linf 4/255", "L2 2", "L1 1.53": radii as the papers quote them."""
    if section["norm"] == "Linf":
        return ThreatModel("Linf", section["eps"]).name.replace("-", " ").replace("_", "/")
    return f"{section['norm']} {section['eps']:.3g}"


def _shift_values(test_metrics: dict[str, float], results: dict[str, Any], imagenet: bool = True) -> dict[str, str]:
    """The distribution-shift row: accuracies in %, mCE and flip rates in % (lower is better where marked).
    ``imagenet``: a 1000-class model; otherwise mCE (normalised by AlexNet's ImageNet errors) means nothing."""
    benchmarks, c, p = results.get("benchmarks", {}), results.get("imagenet_c") or {}, results.get("imagenet_p") or {}
    row = {
        "test set": percent(test_metrics.get("test/acc1")),
        "IN-C mCE ↓": mean_over(c, "mce") if imagenet else "- (not ImageNet)",
        "IN-C acc": percent(c.get("mean_acc1")),
    }
    for name, benchmark in SHIFT_BENCHMARKS.items():
        row[benchmark.column] = percent(benchmarks.get(name, {}).get(benchmark.headline))
    row["IN-P mFR ↓"] = mean_over(p, "mfr")
    # a mean top-5 distance, not AlexNet-normalised (no published AlexNet constants): not a percentage
    row["IN-P mT5D (unnormalised) ↓"] = mean_over(p, "mt5d", plain)
    return row


def summary_row(
    test_metrics: dict[str, float], results: dict[str, Any], imagenet: bool = True
) -> tuple[list[str], list[str]]:
    """One row with every headline number (the W&B table of the card)."""
    row = {"clean": percent(test_metrics.get("test/acc1"))}
    for section in results.get("autoattack", {}).get("threat_models", {}).values():
        if section.get("num_points"):
            row[f"AA {threat_label(section)}"] = percent(section["robust_accuracy"])
    row |= _shift_values(test_metrics, results, imagenet)
    return list(row), list(row.values())


def _sweep_lines(sweep: dict[str, Any]) -> list[str]:
    """Accuracy per test resolution; the best resolution in bold."""
    entries = [e for e in sweep.get("resolutions", {}).values() if e.get("clean_accuracy") is not None]
    if not entries:
        return []
    threats = entries[0].get("threat_models", {})
    names = list(threats)
    # radii as quoted at the reference resolution (a scaled L2 / L1 radius differs per row)
    labels = [threat_label({**t, "eps": t.get("eps_nominal", t["eps"])}) for t in threats.values()]
    best = sweep.get("best", {})
    chosen = (best.get("by_robust") or best.get("by_clean") or {}).get("resolution")
    attack = sweep.get("conditions", {}).get("attack")
    rows = []
    for e in entries:
        label = f"**{e['resolution']}**" if e["resolution"] == chosen else str(e["resolution"])
        robust = [percent(e["threat_models"][n]["robust_accuracy"]) for n in names]
        rows.append([label, str(e["num_images"]), percent(e["clean_accuracy"]), *robust])
    columns = ["resolution", "images", "clean", *(f"{label} ({attack})" for label in labels)]
    return [f"## Test resolution (best: {chosen} px)", "", table(columns, rows), ""]


def raised_check_lines(threats: dict[str, dict[str, Any]]) -> list[str]:
    """A section naming the checks that were raised (results.json's ``checks``): the reference AutoAttack's, and
    the sanity checks of Carlini et al. under their own name, placed before the robust accuracies they qualify;
    none where none was."""
    raised = [
        f"- {name}: `{check}` ({'the reference AutoAttack' if check in REFERENCE_CHECKS else 'Carlini et al.'}): "
        f"{found['advice']}"
        for name, section in threats.items()
        for check, found in section.get("checks", {}).items()
        if found.get("raised")
    ]
    if not raised:
        return []
    return [
        "## Checks raised: standard AutoAttack's robust accuracy below may not hold",
        "",
        *raised,
        "",
    ]


def adaptive_lines(threats: dict[str, dict[str, Any]]) -> list[str]:
    """Where adaptive attacks ran (a check called for them), their figures beside standard AutoAttack's, and the
    lowest per image, which is the number to report; none where none ran."""
    ran = {name: s for name, s in threats.items() if s.get("adaptive")}
    if not ran:
        return []
    attacks = sorted({attack for s in ran.values() for attack in s["adaptive"]})
    rows = [
        [
            threat_label(s),
            percent(s["robust_accuracy"]),
            *(percent(s["adaptive"][a]["robust_accuracy"]) if a in s["adaptive"] else "-" for a in attacks),
            f"**{percent(s['reported_robust_accuracy'])}**",
        ]
        for s in ran.values()
    ]
    return [
        "Adaptive attacks that the raised checks called for, on every image (AutoAttack's figure above stays the "
        "leaderboard's; the lowest per image is the one to report):",
        "",
        table(["threat model", "AutoAttack", *attacks, "reported"], rows),
        "",
    ]


def render_card(
    header: dict[str, Any],
    test_metrics: dict[str, float],
    results: dict[str, Any],
    skipped: list[dict[str, str]],
    papers: list[dict[str, str]],
) -> str:
    """The card as markdown, from the results.json sections of the run (all numbers in %)."""
    r = header["resolution"]
    data = header.get("data") or {}
    lines = [
        f"# Robustness card: {header['arch']}",
        "",
        f"- checkpoint: `{header.get('checkpoint')}`",
        f"- resolution: {r} px; test set: {data.get('source', '?')}"
        + (f", subset {data['eval_subset']}" if data.get("eval_subset") else "")
        + (f", {data['eval_images']} images" if data.get("eval_images") else ""),
        "- all numbers in %; ↓ marks metrics where lower is better",
        "",
    ]

    autoattack = results.get("autoattack", {})
    threats = {name: s for name, s in autoattack.get("threat_models", {}).items() if s.get("num_points")}
    if threats:
        conditions = autoattack.get("conditions", {})
        points = {s["num_points"] for s in threats.values()}
        lines += raised_check_lines(threats)
        lines += [
            f"## Adversarial robustness (AutoAttack {conditions.get('version')}, {conditions.get('precision')}, "
            f"{'/'.join(map(str, sorted(points)))} images)",
            "",
        ]
        labels = [threat_label(s) for s in threats.values()]
        rows = [
            [
                f"this checkpoint ({r} px)",
                percent(next(iter(threats.values()))["clean_accuracy"]),
                *(percent(s["robust_accuracy"]) for s in threats.values()),
            ]
        ]
        columns = [published_column(s["norm"], s["eps"]) for s in threats.values()]
        for paper in papers:
            cells = [(paper.get(column) if column else None) or "-" for column in columns]  # "-": not in the paper
            note = f", {paper['note']}" if paper["note"] else ""
            rows.append(
                [f"{paper['model']}, {paper['paper']} ({paper['resolution']} px{note})", paper["clean"], *cells]
            )
        lines += [table(["model", "clean", *labels], rows), ""]
        unpublished = [label for label, column in zip(labels, columns, strict=True) if column is None]
        if papers and unpublished:  # said, so that a radius off the papers' is not read as a missing number
            published = ", ".join(threat_label({"norm": norm, "eps": float(eps)}) for norm, eps in PUBLISHED_AUTOATTACK)
            lines += [f"No published numbers at {', '.join(unpublished)}: the papers report {published}.", ""]
        lines += adaptive_lines(threats)
        if any(paper.get("source") for paper in papers):
            lines += [
                "Leaderboard numbers: data/robustbench_imagenet_linf.csv (the same weights, RobustBench's "
                "5000 images and preprocessing).",
                "",
            ]
        if any(not paper.get("source") for paper in papers):
            lines += [
                "Published numbers: data/paper_results.csv (same architecture; not necessarily the same weights).",
                "",
            ]

    shift = _shift_values(test_metrics, results, header.get("num_classes", 1000) == 1000)
    if any(not v.startswith("-") for k, v in shift.items() if k != "test set"):
        lines += [
            "## Distribution shifts (top-1 unless marked)",
            "",
            table(["model", *shift], [["this checkpoint", *shift.values()]]),
            "",
        ]
    ece = {"test set": test_metrics.get("test/ece")}
    ece |= {
        benchmark.column: results.get("benchmarks", {}).get(name, {}).get("ece")
        for name, benchmark in SHIFT_BENCHMARKS.items()
        if "ece" in benchmark.keys
    }
    corruptions = (results.get("imagenet_c") or {}).get("corruptions", {})
    if corruptions:
        ece["IN-C"] = sum(c["ece"] for c in corruptions.values()) / len(corruptions)
    if any(v is not None for v in ece.values()):
        lines += [
            "## Calibration (expected calibration error, 15 bins) ↓",
            "",
            table(list(ece), [[percent(v) for v in ece.values()]]),
            "",
        ]
    if corruptions:
        lines += [
            "## ImageNet-C per corruption (error, mean over severities) ↓",
            "",
            table(
                ["corruption", "error", "CE"],
                [[name, percent(c["mean_error"]), percent(c.get("ce"))] for name, c in corruptions.items()],
            ),
            "",
        ]

    sweep = results.get("resolution_sweep")
    if sweep:
        lines += _sweep_lines(sweep)

    plots = [
        (title, Path(path).name)
        for title, path in (
            ("ImageNet-C", (results.get("imagenet_c") or {}).get("plot")),
            ("ImageNet-P", (results.get("imagenet_p") or {}).get("plot")),
            ("Resolution sweep", (sweep or {}).get("plot")),
        )
        if path and path != "not requested"
    ]
    if plots:
        lines += ["## Plots", "", *(f"![{title}]({name})" for title, name in plots), ""]

    everything_skipped = skipped + results.get("benchmarks", {}).get("skipped", [])
    everything_skipped += [
        {"benchmark": f"resolution sweep at {r} px", "reason": reason}
        for r, reason in (sweep or {}).get("skipped_resolutions", {}).items()
    ]
    lines += ["## Skipped", ""]
    lines += [f"- {s['benchmark']}: {s['reason']}" for s in everything_skipped] or ["- nothing"]
    return "\n".join(lines) + "\n"
