"""The built-in synthetic shapes dataset."""

import contextlib
import fcntl
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import webdataset as wds
from PIL import Image

from robust_lightning.data import synthetic
from robust_lightning.data.shards import read_manifest, shard_urls
from robust_lightning.data.synthetic import ensure_synthetic_dataset, synthetic_class_names
from robust_lightning.errors import UserError

# Small enough to generate in about a second, large enough to learn from.
SMALL = dict(
    num_classes=10, train_per_class=100, val_per_class=20, image_size=32, samples_per_shard=250, progress=False
)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return ensure_synthetic_dataset(tmp_path_factory.mktemp("synthetic") / "data", **SMALL)


def _load(directory):
    """(N, 3, H, W) float images in [0, 1] and labels of a split."""
    images, labels = [], []
    for sample in wds.WebDataset(shard_urls(directory), shardshuffle=False):
        images.append(np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB")))
        labels.append(int(sample["cls"]))
    return torch.tensor(np.stack(images)).permute(0, 3, 1, 2).float() / 255, torch.tensor(labels)


def test_layout_and_manifests(small):
    names = synthetic_class_names(10)
    assert len(set(names)) == 10 and names[0] == "circle"
    for split, per_class, shards in (("train", 100, 4), ("val", 20, 1)):
        manifest = read_manifest(small / split)
        assert manifest["num_samples"] == 10 * per_class
        assert manifest["num_classes"] == 10
        assert manifest["classes"] == names
        assert manifest["class_counts"] == {name: per_class for name in names}  # balanced
        assert [s["file"] for s in manifest["shards"]] == [f"{split}-{i:06d}.tar" for i in range(shards)]
        samples = list(wds.WebDataset(shard_urls(small / split), shardshuffle=False))
        assert [s["__key__"] for s in samples] == [f"synthetic_{split}_{i:06d}" for i in range(10 * per_class)]
        for sample in samples[:20]:
            image = Image.open(io.BytesIO(sample["jpg"]))
            assert image.format == "JPEG" and image.size == (32, 32) and image.mode == "RGB"
            assert sample["wnid"].decode() == names[int(sample["cls"])]
    # train and val are independent draws, not copies
    train = next(iter(wds.WebDataset(shard_urls(small / "train"), shardshuffle=False)))
    val = next(iter(wds.WebDataset(shard_urls(small / "val"), shardshuffle=False)))
    assert train["jpg"] != val["jpg"]


def test_deterministic_and_cached(small, tmp_path):
    other = ensure_synthetic_dataset(tmp_path / "again", **{**SMALL, "workers": 1})
    for split in ("train", "val"):
        for a, b in zip(shard_urls(small / split), shard_urls(other / split), strict=True):
            assert Path(a).read_bytes() == Path(b).read_bytes()

    before = {p: p.stat().st_mtime_ns for p in other.rglob("*")}
    assert ensure_synthetic_dataset(tmp_path / "again", **SMALL) == tmp_path / "again"
    assert {p: p.stat().st_mtime_ns for p in other.rglob("*")} == before


def test_changed_params_regenerate(tmp_path):
    params = dict(SMALL, train_per_class=3, val_per_class=2)
    root = ensure_synthetic_dataset(tmp_path / "d", **params)
    old = (root / "val" / "val-000000.tar").read_bytes()
    ensure_synthetic_dataset(root, **{**params, "seed": 1})
    assert (root / "val" / "val-000000.tar").read_bytes() != old
    assert read_manifest(root / "train")["num_samples"] == 30
    assert not list(root.glob(".tmp-*"))


def test_killed_generation_leaves_old_dataset_and_recovers(tmp_path, monkeypatch):
    params = dict(SMALL, train_per_class=3, val_per_class=2)
    root = ensure_synthetic_dataset(tmp_path / "d", **params)
    old = (root / "train" / "train-000000.tar").read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_synthetic_dataset(root, **{**params, "seed": 5})
    # The complete old dataset is untouched and still recognised; the half-written one is not visible.
    assert (root / "train" / "train-000000.tar").read_bytes() == old
    mtime = (root / "train" / "train-000000.tar").stat().st_mtime_ns
    ensure_synthetic_dataset(root, **params)  # still complete: returns at once
    assert (root / "train" / "train-000000.tar").stat().st_mtime_ns == mtime
    monkeypatch.undo()
    ensure_synthetic_dataset(root, **{**params, "seed": 5})
    assert not list(root.glob(".tmp-*"))
    assert (root / "train" / "train-000000.tar").read_bytes() != old


def test_concurrent_callers_generate_once(tmp_path, monkeypatch):
    calls = []
    generate = synthetic._generate

    def counting(*args, **kwargs):
        calls.append(1)
        return generate(*args, **kwargs)

    monkeypatch.setattr(synthetic, "_generate", counting)
    params = dict(SMALL, train_per_class=2, val_per_class=1, workers=1)
    threads = [
        threading.Thread(target=ensure_synthetic_dataset, args=(tmp_path / "d",), kwargs=params) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert read_manifest(tmp_path / "d" / "val")["num_samples"] == 10


def test_bad_parameters(tmp_path):
    with pytest.raises(UserError, match="num_classes"):
        ensure_synthetic_dataset(tmp_path, num_classes=len(synthetic.CLASS_NAMES) + 1)
    with pytest.raises(UserError, match="image_size"):
        ensure_synthetic_dataset(tmp_path, image_size=4)


def test_all_classes_render():
    names = synthetic_class_names(len(synthetic.CLASS_NAMES))
    for label in range(len(names)):
        sample = synthetic.synthetic_sample(3, "train", label, num_classes=len(names), image_size=48)
        assert sample["wnid"] == names[label]
        assert Image.open(io.BytesIO(sample["jpg"])).size == (48, 48)


def _linear_probe(train_x, train_y, val_x, val_y, steps=300):
    """Validation accuracy of a multinomial logistic regression on standardised features."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, val_x = (train_x - mean) / std, (val_x - mean) / std
    linear = nn.Linear(train_x.shape[1], 10)
    optimizer = torch.optim.Adam(linear.parameters(), lr=0.05)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(linear(train_x), train_y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (linear(val_x).argmax(1) == val_y).float().mean().item()


@pytest.fixture
def one_thread():
    # Small convolutions run faster on one thread, and far faster when other processes share the CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_classes_are_shapes_not_colours(small, one_thread):
    torch.manual_seed(0)
    train_x, train_y = _load(small / "train")
    val_x, val_y = _load(small / "val")

    # Mean colour alone carries no label information: chance is 0.1.
    colour_acc = _linear_probe(train_x.mean((2, 3)), train_y, val_x.mean((2, 3)), val_y)
    assert colour_acc < 0.22

    # A tiny CNN learns the shapes within a few seconds of CPU time.
    def block(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2))

    net = nn.Sequential(
        block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(64, 10)
    )
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(10):
        net.train()
        for idx in torch.randperm(len(train_x)).split(64):
            loss = nn.functional.cross_entropy(net(train_x[idx]), train_y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    net.eval()
    with torch.no_grad():
        cnn_acc = (net(val_x).argmax(1) == val_y).float().mean().item()
    print(f"CNN val accuracy {cnn_acc:.2f}, mean-colour {colour_acc:.2f}")
    assert cnn_acc > 0.45, f"CNN val accuracy {cnn_acc:.2f}, mean-colour {colour_acc:.2f}"


GENERATE = textwrap.dedent(
    """
    # ensure_synthetic_dataset with two pool workers whose shards take longer than the test waits
    import os, sys, time
    from pathlib import Path
    from robust_lightning.data import synthetic
    from robust_lightning.job_signals import shield_forked_children

    shield_forked_children()  # as every command does: its children ignore the job's SIGTERM
    started = Path(sys.argv[2])

    def slow_shard(*args):
        (started / str(os.getpid())).write_text("")
        time.sleep(120)

    synthetic._write_synthetic_shard = slow_shard  # the forked workers run it too
    synthetic.ensure_synthetic_dataset(
        sys.argv[1], num_classes=2, train_per_class=4, val_per_class=2, image_size=16, samples_per_shard=2, workers=2
    )
    """
)


def ended(pid: int) -> bool:
    """Whether a process is gone or a zombie (an orphan's new parent may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_killed_generation_takes_its_pool_workers_with_it_and_frees_the_lock(tmp_path):
    """``kill`` of a command that generates the synthetic dataset ends its pool workers too. Before, they ignored
    the signal (as every child of a command does) and outlived their parent, waiting for work for ever and holding
    the dataset's lock, so that the next command that needed the dataset waited for ever too."""
    script, started, root = tmp_path / "generate.py", tmp_path / "started", tmp_path / "data"
    script.write_text(GENERATE)
    started.mkdir()
    process = subprocess.Popen([sys.executable, str(script), str(root), str(started)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(started.iterdir())) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(path.name) for path in started.iterdir()]
        assert len(workers) == 2, f"the generation ended with status {process.poll()} before its workers started"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
        deadline = time.monotonic() + 30
        while not all(ended(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(ended(pid) for pid in workers)
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while a worker holds it
    finally:
        for pid in [process.pid, *[int(path.name) for path in started.iterdir()]]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
