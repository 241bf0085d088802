"""The manual: README.md is a front page that links into docs/, and docs/ builds into a site with
`mkdocs build --strict` (every page in the navigation, every link and API reference resolving)."""

import os
import re
import subprocess
import sys

import yaml
from markdown.extensions.toc import slugify

from helpers import REPO

DOCS = REPO / "docs"


def _anchors(page) -> set[str]:
    """The heading ids mkdocs gives a page (its toc extension's slugify)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' comment in a code block is no heading
    return {slugify(heading, "-") for heading in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readme_is_a_front_page_whose_links_into_docs_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert {page for page, _ in links} == {f"docs/{page.name}" for page in DOCS.glob("*.md")} - {"docs/index.md"}
    for page, anchor in links:
        assert (REPO / page).is_file(), page
        assert not anchor or anchor in _anchors(REPO / page), f"{page}#{anchor}"


def test_every_page_is_in_the_site_navigation():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    in_nav = {next(iter(entry.values())) for entry in config["nav"]}
    assert in_nav == {page.name for page in DOCS.glob("*.md")}


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in (
        "load_model",
        "any_model.evaluate",
        "attacks.ensemble.AutoAttack",
        "evaluation.base.Evaluation",
        "training.lightning_module.ImageClassifier",
        "data.datamodule.ImageNetDataModule",
    ):
        assert f'id="robust_lightning.{name}"' in api, name  # an entry with its docstring, from the source


def test_the_evaluations_the_manual_names_are_those_evaluate_runs():
    from robust_lightning.any_model import evaluation_names

    text = " ".join((DOCS / "evaluation.md").read_text().split())
    sentence = re.search(r"The evaluations are named (.+?)\. ", text)
    assert sentence is not None
    assert re.findall(r"`(\w+)`", sentence.group(1)) == evaluation_names()
