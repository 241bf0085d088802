"""docs/results-json.md against the results.json files that real runs write: a fit with adversarial training, EMA
and AutoAttack after it, then a `test` of its checkpoint with AutoAttack. Every key in the files is in the tables,
and every key the tables do not mark "Only ..." is in the files."""

import json
import re

import pytest

from helpers import REPO, tiny_config
from robust_lightning.cli import main
from robust_lightning.evaluation.base import Evaluation

DOC = (REPO / "docs" / "results-json.md").read_text()
# the parent keys whose children are a family, written in the tables as one placeholder
FAMILIES = {
    "threat_models": "<threat model>",
    "robust_accuracy_after": "<attack>",
    "seconds_this_session": "<attack>",
    "claims_refuted_in_fp32_this_session": "<attack>",
    "checks": "<check>",
    "figures": "<figure>",
    "versions": "<package>",
    "corrupt_images": "<split>",
    "eval_image_counts": "<split>",
    "metrics": "<metric>",
}


def table_rows(heading: str, until: str = "\n## ") -> dict[str, str]:
    """The rows `key` | meaning of the tables after a heading, up to the next heading of its level."""
    start = DOC.index(f"\n{heading}\n")
    end = DOC.find(until, start + 1)
    text = DOC[start : end if end != -1 else None]
    return dict(re.findall(r"^\| `([^`]+)` \| (.*) \|$", text, re.M))


def key_paths(node: dict, parent: str = "") -> set[str]:
    paths = set()
    for key, value in node.items():
        leaf = parent.rsplit(".", 1)[-1]
        name = FAMILIES.get(leaf, key) if parent else key
        path = f"{parent}.{name}" if parent else name
        paths.add(path)
        if isinstance(value, dict):
            paths |= key_paths(value, path)
    return paths


def required(rows: dict[str, str]) -> set[str]:
    return {key for key, meaning in rows.items() if not meaning.startswith("Only")}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("results")
    autoattack = {
        "class_path": "robust_lightning.evaluation.autoattack.AutoAttackEvaluation",
        "init_args": {
            "version": "apgd-ce",
            "n_iter": 2,
            "fit_images": 8,
            "threat_models": [{"norm": "Linf", "eps": 4 / 255}],
        },
    }
    # tiny_config's bar off and no loader workers: results.json's keys do not depend on them (the user's defaults
    # run in tests/test_ddp_commands.py)
    config = tiny_config(
        tmp_path,
        **{
            "trainer.callbacks": [autoattack],
            "data.eval_limit": 8,
            "model.attack": "apgd",
            "model.attack_steps": 1,
            "model.select_attack_steps": 1,
            "model.ema_decay": 0.9,
            "trainer.log_every_n_steps": 1,
        },
    )  # throughput is summed over logging intervals
    assert main(["fit", "--config", str(config)]) == 0
    fitted = tmp_path / "runs" / "tiny" / "version_0"
    assert main(["test", "--config", str(config), "--ckpt_path", str(fitted / "checkpoints" / "last.ckpt")]) == 0
    tested = tmp_path / "runs" / "tiny" / "version_1"
    return [json.loads((run / "results.json").read_text()) for run in (fitted, tested)]


def test_the_run_sections_keys_are_the_documented_ones(written):
    fit, test = written[0]["fit"], written[1]["test"]
    rows = {**table_rows("## fit, validate, test", until="\n### "), **table_rows("### Conditions")}
    documented = set(rows)
    for section, paths in (("fit", key_paths(fit)), ("test", key_paths(test))):
        assert paths <= documented, f"{section}: undocumented {sorted(paths - documented)}"
        only_here = {
            k
            for k, m in rows.items()
            if m.startswith(f"Only `{section}`") or (section == "test" and m.startswith("Only `validate` and `test`"))
        }
        # the synthetic source, adversarial training, reduced decoding: the rows of this run's settings
        this_run = {
            k
            for k, m in rows.items()
            if m.startswith(
                (
                    "Only adversarial training",
                    "Only source `synthetic`",
                    "Only sources `synthetic`",
                    "Only with reduced",
                )
            )
        }
        missing = (required(rows) | only_here | this_run) - paths
        assert not missing, f"{section}: documented but not written: {sorted(missing)}"


def test_every_metric_is_documented(written):
    rows = table_rows("### Metrics", until="\n### ")
    names = {
        re.sub(r"^(val|test)(_ema)?/", "<split>/", name)
        for results in written
        for section in ("fit", "test")
        if section in results
        for name in results[section]["metrics"]
    }
    assert names <= set(rows), sorted(names - set(rows))
    assert (required(rows) | {k for k, m in rows.items() if m.startswith("Only adversarial training")}) <= names
    assert any(name.startswith("val_ema/") for name in written[0]["fit"]["metrics"])  # the EMA family is written


def test_the_autoattack_keys_are_the_documented_ones(written):
    rows = table_rows("## autoattack")
    for results in written:
        paths = key_paths(results["autoattack"])
        assert paths <= set(rows), sorted(paths - set(rows))
        assert required(rows) <= paths, sorted(required(rows) - paths)


def test_every_evaluation_section_is_listed():
    import robust_lightning.evaluation.benchmarks
    import robust_lightning.evaluation.card
    import robust_lightning.evaluation.imagenet_c
    import robust_lightning.evaluation.imagenet_p
    import robust_lightning.evaluation.resolution  # noqa: F401
    from robust_lightning.analysis.core import Analysis

    def subclasses(cls):
        return {cls, *(s for child in cls.__subclasses__() for s in subclasses(child))}

    sections = set(table_rows("## Sections"))
    evaluation_classes = subclasses(Evaluation) - subclasses(Analysis)
    ours = {cls for cls in evaluation_classes if cls.__module__.startswith("robust_lightning.")}
    evaluations = {cls.name for cls in ours} - {Evaluation.name}  # not the tests' own evaluations
    assert evaluations <= sections, sorted(evaluations - sections)
    assert {"fit", "validate", "test", "sweep", "<analysis>"} <= sections
