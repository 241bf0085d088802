"""A truncated evaluation shard is reported with the expected and read image counts: an error by default, a
warning plus the counts in results.json with data.on_missing_images warn. Corrupt images inside whole shards
are counted apart (read but undecodable)."""

import json
import tarfile
from pathlib import Path

import pytest

from helpers import tiny_config, trainer_args
from robust_lightning.cli import main
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.errors import UserError

VAL_IMAGES = 16  # 4 classes x 4 images, 4 per shard


@pytest.fixture
def truncated(tmp_path):
    """A tiny synthetic shard set whose second validation shard is cut in the middle of the file."""
    config = tiny_config(tmp_path, tmp_path / "synthetic", **{"data.source.init_args.samples_per_shard": 4})
    assert main(["validate", "--config", str(config)]) == 0  # writes the shards; whole, every image is read
    whole = json.loads(next((tmp_path / "runs").glob("tiny/version_*/results.json")).read_text())["validate"]
    assert whole["metrics"]["val/num_images"] == whole["metrics"]["val/expected_images"] == VAL_IMAGES
    assert whole["metrics"]["val/missing_images"] == 0
    shards = sorted((tmp_path / "synthetic" / "val").glob("*.tar"))
    assert len(shards) == 4
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    return config, shards[1]


def _error_line(err: str) -> str:
    assert "Traceback" not in err
    return next(line for line in err.splitlines() if line.startswith("robust-lightning: error:"))


def test_a_truncated_shard_stops_validation_naming_it(truncated, capsys):
    config, shard = truncated
    assert main(["validate", "--config", str(config)]) == 2
    message = _error_line(capsys.readouterr().err)
    assert shard.name in message


def test_a_listed_image_absent_from_the_shards_stops_validation_with_the_counts(tmp_path, capsys):
    config = tiny_config(tmp_path, tmp_path / "synthetic", **{"data.source.init_args.samples_per_shard": 4})
    assert main(["validate", "--config", str(config)]) == 0  # writes the shards
    listed = []
    for shard in sorted((tmp_path / "synthetic" / "val").glob("*.tar")):
        with tarfile.open(shard) as tar:
            listed += [
                f"{tar.extractfile(m).read().decode()}/{Path(m.name).stem}.JPEG"
                for m in tar.getmembers()
                if m.name.endswith(".wnid")
            ]
    assert len(listed) == VAL_IMAGES
    subset = tmp_path / "subset.txt"
    subset.write_text("\n".join([*listed, f"{listed[0].split('/')[0]}/not_in_any_shard.JPEG"]))
    assert main(["validate", "--config", str(config), "--data.eval_subset", str(subset)]) == 2
    message = _error_line(capsys.readouterr().err)
    assert (
        f"read {VAL_IMAGES} of the {VAL_IMAGES + 1} evaluation images (1 missing, 0 of those read undecodable)"
        in message
    )


def test_warn_mode_evaluates_what_is_there_and_records_the_counts(truncated, tmp_path):
    config, _ = truncated
    out = tmp_path / "warned"
    with pytest.warns(UserWarning, match="evaluation images"):
        assert (
            main(
                trainer_args(
                    "validate",
                    config,
                    {"data.on_missing_images": "warn", "trainer.logger.init_args.save_dir": str(out)},
                )
            )
            == 0
        )
    results = json.loads(next(out.glob("tiny/version_*/results.json")).read_text())["validate"]
    counts, metrics = results["eval_image_counts"]["val"], results["metrics"]
    # independent count: the images the loop evaluated (val/num_images) plus those it could not decode
    assert counts["read"] == metrics["val/num_images"] + counts["corrupt"] < VAL_IMAGES
    assert counts["expected"] == metrics["val/expected_images"] == VAL_IMAGES
    assert counts["missing"] == metrics["val/missing_images"] == VAL_IMAGES - counts["read"]


def test_on_missing_images_accepts_only_error_or_warn():
    with pytest.raises(UserError, match="on_missing_images"):
        ImageNetDataModule(on_missing_images="ignore")
