"""The project's own files agree: one version (robust_lightning.__version__) that the package metadata, the
citation file and the changelog repeat, and a licence the package metadata names."""

import importlib.metadata
import tomllib

import yaml

import robust_lightning
from helpers import REPO


def test_the_version_is_written_once_and_everything_else_reads_or_matches_it():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "robust_lightning.__version__"}
    assert importlib.metadata.version("robust-lightning") == robust_lightning.__version__
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert citation["version"] == robust_lightning.__version__
    assert f"## {robust_lightning.__version__} " in (REPO / "CHANGELOG.md").read_text()


def test_the_licence_file_is_the_one_the_metadata_names():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    licence = (REPO / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert importlib.metadata.metadata("robust-lightning")["License-Expression"] == "Apache-2.0"
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert citation["license"] == "Apache-2.0" and citation["cff-version"] == "1.2.0"


def test_pre_commit_runs_the_ruff_that_make_test_runs():
    hooks = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())["repos"]
    (ruff,) = [repo for repo in hooks if repo["repo"].endswith("ruff-pre-commit")]
    assert {hook["id"] for hook in ruff["hooks"]} == {"ruff-check", "ruff-format"}
    installed = importlib.metadata.version("ruff").split(".")[:2]
    assert ruff["rev"].removeprefix("v").split(".")[:2] == installed  # formatting changes between minor versions


def test_the_package_metadata_names_authors_links_and_classifiers():
    metadata = importlib.metadata.metadata("robust-lightning")
    assert metadata.get_all("Author") == ["the robust-lightning authors"]
    assert any("github.com/nmndeep/revisiting-at" in url for url in metadata.get_all("Project-URL"))
    classifiers = metadata.get_all("Classifier")
    assert "Intended Audience :: Science/Research" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # the SPDX expression says it (PEP 639)
