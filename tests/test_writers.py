"""Two writers of the same thing: shards, a fit's run and checkpoint directories, an AutoAttack outcome folder.
The second stops at once with a message naming the first (no traceback, nothing corrupted), a killed writer
leaves no stuck lock, and ``--ckpt_path last`` only resumes what a fit wrote."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from helpers import REPO, eval_config, make_image_tree, tiny_config, trainer_args
from robust_lightning.cli import main
from robust_lightning.data.shards import read_manifest, shard_urls
from robust_lightning.errors import UserError
from robust_lightning.evaluation.outcomes import claim_directory
from robust_lightning.evaluation.results import file_sha256
from robust_lightning.locking import LOCK_NAME, exclusive


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_holder(lock_file: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``process`` holds the lock (it records its pid in the lock file once it has it)."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        try:
            if json.loads(lock_file.read_text())["pid"] == process.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"the lock was never taken: {process.communicate()}")


def test_a_lock_is_released_when_its_holder_is_killed(tmp_path):
    lock_file = tmp_path / "out" / LOCK_NAME
    holder = _python(f"""
        import time
        from robust_lightning.locking import exclusive
        with exclusive({str(lock_file)!r}, "the test folder"):
            time.sleep(600)
    """)
    try:
        _wait_for_holder(lock_file, holder)
        with pytest.raises(UserError, match=rf"the test folder is being written by pid {holder.pid} on "):
            with exclusive(lock_file, "the test folder"):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with exclusive(lock_file, "the test folder"):  # the OS released it with the process
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    with exclusive(lock_file, "the test folder"):  # and released on leaving the block
        pass


def test_forked_workers_do_not_keep_a_lock(tmp_path):
    """A worker forked while the lock is held (a DataLoader or shard worker) must not hold it after its parent is
    killed: flock lasts as long as any process keeps the descriptor open."""
    lock_file, worker_pid = tmp_path / LOCK_NAME, tmp_path / "worker.pid"
    holder = _python(f"""
        import os, time
        from pathlib import Path
        from robust_lightning.locking import exclusive
        with exclusive({str(lock_file)!r}, "the test folder"):
            worker = os.fork()
            if worker == 0:  # the worker outlives its parent
                time.sleep(120)
                os._exit(0)
            Path({str(worker_pid)!r}).write_text(str(worker))
            time.sleep(600)
    """)
    try:
        _wait_for_holder(lock_file, holder)
        while not (worker_pid.exists() and worker_pid.read_text()):  # written, not only created
            time.sleep(0.05)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    worker = int(worker_pid.read_text())
    try:
        os.kill(worker, 0)  # the orphaned worker is still running...
        with exclusive(lock_file, "the test folder"):  # ...without the lock
            pass
    finally:
        os.kill(worker, signal.SIGKILL)


def test_two_shards_commands_into_one_folder(tmp_path, capsys):
    """A converter in another process holds the folder: this process's command stops with a message naming it."""
    src = make_image_tree(tmp_path / "train", {"n01440764": 5, "n01443537": 4, "n15075141": 3})
    out, go = tmp_path / "shards", tmp_path / "go"
    command = ["shards", str(src), str(out), "--samples_per_shard", "4", "--workers", "1"]
    # the first converter pauses before each shard until the test lets it go: the second starts meanwhile
    first = _python(f"""
        import sys, time
        from pathlib import Path
        import robust_lightning.data.shards as shards
        convert = shards._convert_shard
        def paused(*args):
            deadline = time.time() + 120
            while not Path({str(go)!r}).exists() and time.time() < deadline:
                time.sleep(0.05)
            return convert(*args)
        shards._convert_shard = paused
        from robust_lightning.cli import main
        sys.exit(main({command!r}))
    """)
    try:
        _wait_for_holder(out / LOCK_NAME, first)
        capsys.readouterr()
        assert main(command) == 2  # the second, in this process (a lock is held per process)
        stderr = capsys.readouterr().err
        assert f"shard directory {out} is being written by pid {first.pid}" in stderr
        assert "Traceback" not in stderr
        go.touch()
        _stdout, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, stderr
    # the shard set is complete and readable: every image once, under its folder's label
    manifest = read_manifest(out)
    samples = {}
    for url in shard_urls(out):
        with tarfile.open(url) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    images = sorted(src.glob("*/*.JPEG"))
    assert manifest["num_samples"] == len(samples) == len(images) == 12
    labels = {"n01440764": b"0", "n01443537": b"1", "n15075141": b"999"}
    for path in images:
        assert samples[path.stem]["jpg"] == path.read_bytes() and samples[path.stem]["cls"] == labels[path.parent.name]
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    # once the first is done, the same command finds the set complete
    assert main(command) == 0
    assert read_manifest(out) == manifest


@pytest.fixture
def fixed_dirpath_config(tmp_path):
    """The quickstart's layout: versioned run directories under runs/tiny, checkpoints in one fixed folder."""
    return tiny_config(
        tmp_path,
        **{
            "checkpoint.dirpath": str(tmp_path / "runs" / "tiny" / "checkpoints"),
            "checkpoint.enable_version_counter": False,
        },
    )


def test_a_second_fit_into_a_fixed_checkpoint_dirpath_is_refused(tmp_path, fixed_dirpath_config, capsys):
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    assert main(["fit", "--config", str(fixed_dirpath_config)]) == 0
    first = tmp_path / "runs" / "tiny" / "version_0"
    before = {p.name: file_sha256(p) for p in checkpoints.glob("*.ckpt")}
    capsys.readouterr()
    assert main(["fit", "--config", str(fixed_dirpath_config)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.dirpath {checkpoints} holds the checkpoints of the run in {first}" in err
    assert "--ckpt_path last" in err
    assert {p.name: file_sha256(p) for p in checkpoints.glob("*.ckpt")} == before  # nothing overwritten
    # the first run's results.json hashes the files it names, which are still its own
    fit = json.loads((first / "results.json").read_text())["fit"]
    for key in ("last_checkpoint", "best_checkpoint"):
        assert Path(fit[key]["path"]).parent == checkpoints
        assert fit[key]["sha256"] == file_sha256(fit[key]["path"])
    # resuming the run that owns them is allowed, in its own run directory
    assert main(["fit", "--config", str(fixed_dirpath_config), "--trainer.max_epochs", "2", "--ckpt_path", "last"]) == 0
    fit = json.loads((first / "results.json").read_text())["fit"]
    assert fit["epochs"] == 2 and fit["last_checkpoint"]["sha256"] == file_sha256(checkpoints / "last.ckpt")
    assert not (tmp_path / "runs" / "tiny" / "version_1" / "results.json").exists()
    # so is a new run resuming from one of them by path: it would overwrite them as well
    assert (
        main(
            trainer_args(
                "fit", fixed_dirpath_config, {"trainer.max_epochs": "3", "ckpt_path": str(checkpoints / "last.ckpt")}
            )
        )
        == 2
    )
    assert f"holds the checkpoints of the run in {first}" in capsys.readouterr().err
    assert json.loads((first / "results.json").read_text())["fit"]["last_checkpoint"]["sha256"] == file_sha256(
        checkpoints / "last.ckpt"
    )
    # checkpoints that name no run (copied in, or saved before runs were recorded): a new fit is refused, a fit
    # resuming from one of them by path continues them
    (checkpoints / ".run_directory").unlink()
    assert main(["fit", "--config", str(fixed_dirpath_config)]) == 2
    assert f"checkpoint.dirpath {checkpoints} holds checkpoints of an earlier run" in capsys.readouterr().err
    resume = ["--trainer.max_epochs", "3", "--ckpt_path", str(checkpoints / "last.ckpt")]
    assert main(["fit", "--config", str(fixed_dirpath_config), *resume]) == 0
    assert torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["epoch"] == 2


def test_a_fit_into_a_run_directory_in_use_is_refused(tmp_path, fixed_dirpath_config, capsys):
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    with exclusive(run_dir / LOCK_NAME, "held by the test"):  # another fit writing version_0
        assert main(["fit", "--config", str(fixed_dirpath_config), "--trainer.logger.init_args.version", "0"]) == 2
    err = capsys.readouterr().err
    assert f"run directory {run_dir} is being written by pid {os.getpid()}" in err and "Traceback" not in err
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    assert not list(checkpoints.glob("*.ckpt")) and not (checkpoints / ".run_directory").exists()
    with exclusive(checkpoints / LOCK_NAME, "held by the test"):  # another fit (another run) saving there
        assert main(["fit", "--config", str(fixed_dirpath_config)]) == 2
    assert f"checkpoint directory {checkpoints} is being written by pid {os.getpid()}" in capsys.readouterr().err
    assert not list(checkpoints.glob("*.ckpt"))


def test_ckpt_path_last_without_an_earlier_fit_says_so_and_starts_one(tmp_path, caplog):
    """One command serves every restart: --ckpt_path last with nothing to resume starts the run (and says so);
    a validate's run directory is never taken for a fit's."""
    config = tiny_config(tmp_path)
    checkpoint_file = tmp_path / "model.ckpt"
    assert (
        main(
            trainer_args("fit", config, {"trainer.logger": "false", "checkpoint.dirpath": str(tmp_path / "elsewhere")})
        )
        == 0
    )
    (tmp_path / "elsewhere" / "last.ckpt").rename(checkpoint_file)
    assert main(["validate", "--config", str(config), "--ckpt_path", str(checkpoint_file)]) == 0
    assert (tmp_path / "runs" / "tiny" / "version_0" / "results.json").is_file()  # a validate's run directory
    caplog.clear()
    with caplog.at_level("INFO"):
        assert main(["fit", "--config", str(config), "--ckpt_path", "last"]) == 0
    assert f"no earlier fit of this config in {tmp_path / 'runs' / 'tiny'}; starting one" in caplog.text
    assert "fit" not in json.loads((tmp_path / "runs" / "tiny" / "version_0" / "results.json").read_text())
    assert json.loads((tmp_path / "runs" / "tiny" / "version_1" / "results.json").read_text())["fit"]["steps"] == 3


def test_a_fit_killed_before_its_first_checkpoint_restarts_with_ckpt_path_last(tmp_path, caplog, capsys):
    """A fixed checkpoint.dirpath (the quickstart's, the recipes'): the killed run owns it with no checkpoint in
    it. Plain fit is refused (the folder is that run's); --ckpt_path last starts that run afresh in its directory."""
    config = tiny_config(tmp_path)
    checkpoints = tmp_path / "ckpts"
    fixed = ["--checkpoint.dirpath", str(checkpoints)]
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    # what a fit killed before its first checkpoint leaves: its markers, and the temporary file of a cut save
    assert main(["fit", "--config", str(config), *fixed, "--trainer.max_epochs", "0"]) == 0
    assert not list(checkpoints.glob("*.ckpt")) and (checkpoints / ".run_directory").is_file()
    (checkpoints / ".last.ckpt.tmp-4242").write_bytes(b"PK\x03\x04 cut")
    capsys.readouterr()
    assert main(["fit", "--config", str(config), *fixed]) == 2
    assert "resume that run with --ckpt_path last" in capsys.readouterr().err
    caplog.clear()
    with caplog.at_level("INFO"):
        assert main(["fit", "--config", str(config), *fixed, "--ckpt_path", "last"]) == 0
    assert f"no intact checkpoint in {checkpoints} (the run in {run_dir})" in caplog.text
    assert "starts afresh in the same run directory" in caplog.text
    assert json.loads((run_dir / "results.json").read_text())["fit"]["steps"] == 3
    assert not (tmp_path / "runs" / "tiny" / "version_1").exists()


def test_ckpt_path_last_passes_over_a_damaged_last_checkpoint(tmp_path, caplog):
    """After a disk-full failure: last.ckpt cut short, an intact per-epoch checkpoint beside it; the resume starts
    from the latter and the message names what is on disk."""
    config = tiny_config(tmp_path, **{"trainer.max_epochs": 2, "checkpoint.save_top_k": -1})
    assert main(["fit", "--config", str(config), "--trainer.max_epochs", "1"]) == 0
    checkpoints = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    [epoch0] = checkpoints.glob("epoch000-*.ckpt")
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])  # a save that the full disk cut short
    caplog.clear()
    with caplog.at_level("INFO"):
        assert main(["fit", "--config", str(config), "--ckpt_path", "last"]) == 0
    assert f"resuming from {epoch0}, the newest intact checkpoint" in caplog.text
    assert "last.ckpt is damaged" in caplog.text
    fit = json.loads((tmp_path / "runs" / "tiny" / "version_0" / "results.json").read_text())["fit"]
    assert (fit["epochs"], fit["steps"]) == (2, 6)


def test_a_second_autoattack_evaluation_into_one_outcome_folder_is_refused(tmp_path, checkpoint, capsys):
    ckpt, synthetic_root = checkpoint
    config = eval_config(tmp_path, synthetic_root)
    holder = _python(f"""
        import time
        from pathlib import Path
        from contextlib import ExitStack
        from robust_lightning.evaluation.outcomes import claim_directory
        with ExitStack() as locks:
            claim_directory(Path({str(tmp_path / "held")!r}), {{}}, True, "AutoAttackEvaluation", locks)
            time.sleep(600)
    """)
    try:
        _wait_for_holder(tmp_path / "held" / LOCK_NAME, holder)
        with pytest.raises(
            UserError,
            match=f"AutoAttackEvaluation outcome folder {tmp_path / 'held'} is being written by pid {holder.pid}",
        ):
            with ExitStack() as locks:
                claim_directory(tmp_path / "held", {}, True, "AutoAttackEvaluation", locks)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # through the command: an evaluation holding the folder's lock refuses a second one, which writes nothing
    assert main(["test", "--config", str(config), "--ckpt_path", str(ckpt), "--trainer.limit_test_batches", "1"]) == 0
    folder = next(p for p in (tmp_path / "outcomes").iterdir() if p.is_dir())
    records = (folder / "rank0.jsonl").read_text()
    with exclusive(folder / LOCK_NAME, "held by the test"):
        assert main(["test", "--config", str(config), "--ckpt_path", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert f"AutoAttackEvaluation outcome folder {folder} is being written by pid {os.getpid()}" in err
    assert (folder / "rank0.jsonl").read_text() == records


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB filesystem: smaller than any checkpoint, so writing one fills it."""
    mount = tmp_path / "tiny-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(
            f"cannot mount a tiny filesystem on this machine ({done.stderr.strip() or 'not root'}); the "
            "other unwritable outputs are probed in tests/test_probes.py"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_one_message_and_leaves_nothing_half_written(tmp_path, full_disk, capsys):
    config = tiny_config(tmp_path, **{"model.arch": "test_resnet"})
    assert main(["fit", "--config", str(config), "--checkpoint.dirpath", str(full_disk / "ckpts")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {full_disk / 'ckpts'}/" in err and "No space left on device" in err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert not [p for p in (full_disk / "ckpts").iterdir() if p.suffix == ".ckpt" or ".tmp-" in p.name]
    # the export of a checkpoint to the full disk: the same
    saved = tmp_path / "model.ckpt"
    assert (
        main(
            trainer_args("fit", config, {"trainer.logger": "false", "checkpoint.dirpath": str(tmp_path / "elsewhere")})
        )
        == 0
    )
    (tmp_path / "elsewhere" / "last.ckpt").rename(saved)
    capsys.readouterr()
    assert main(["export", str(saved), str(full_disk / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err
    assert not (full_disk / "model.safetensors").exists()


@pytest.fixture
def checkpoint(autoattack_checkpoint):
    """The session's tiny AutoAttack checkpoint (tests/conftest.py) and its synthetic data."""
    return autoattack_checkpoint
