"""results.json has one writer (robust_lightning.evaluation.results.ResultsFile): each stage and evaluation hands it
its section, readers in the same process get the sections from it, and what another process wrote is kept."""

import json
import os
import traceback
from pathlib import Path

from helpers import run_test
from robust_lightning.atomic import atomic_write_json
from robust_lightning.evaluation.results import ResultsFile


def test_sections_handed_to_the_writer_are_merged_into_the_file(tmp_path):
    writer = ResultsFile.of(tmp_path)
    assert ResultsFile.of(tmp_path / ".") is writer  # one writer per file in a process
    writer.write({"fit": {"metrics": {"val/acc1": 0.5}}})
    writer.write({"autoattack": {"robust_accuracy": 0.25}})
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert (
        on_disk == writer.sections == {"fit": {"metrics": {"val/acc1": 0.5}}, "autoattack": {"robust_accuracy": 0.25}}
    )


def test_what_another_process_wrote_since_is_kept(tmp_path):
    writer = ResultsFile.of(tmp_path)
    writer.write({"test": {"metrics": {"test/acc1": 0.75}}})
    # a sweep's bookkeeping in another process rewrites the file (a new file: another stamp)
    atomic_write_json(tmp_path / "results.json", {**writer.sections, "sweep": {"status": "running"}})
    assert writer.sections["sweep"] == {"status": "running"}
    writer.write({"imagenet_c": {"mean_acc1": 0.4}})
    assert set(json.loads((tmp_path / "results.json").read_text())) == {"test", "sweep", "imagenet_c"}


def test_every_write_of_results_json_in_a_run_goes_through_the_writer(tmp_path, autoattack_checkpoint, monkeypatch):
    """A `test` with AutoAttack (the stage's section and the evaluation's): each rename that puts a results.json in
    place is made inside ResultsFile.write. The config loads in the main process (no workers): the writes come
    from the callbacks on rank zero, which loader workers never reach."""
    writes = []
    replace = os.replace

    def recording_replace(source, target):
        if Path(target).name == "results.json":
            writes.append({(Path(frame.filename).name, frame.name) for frame in traceback.extract_stack()})
        replace(source, target)

    monkeypatch.setattr(os, "replace", recording_replace)
    section = run_test(tmp_path, autoattack_checkpoint)
    assert section["threat_models"] and len(writes) >= 2  # the autoattack section, then the test stage's
    assert all(("results.py", "write") in frames for frames in writes)  # ResultsFile.write
