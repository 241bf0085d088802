"""Test helpers: tiny ImageFolder trees with real images, a callback recording which samples each rank saw, and a
recorder of the ops that would make the host wait for a GPU."""

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import yaml
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.types import STEP_OUTPUT
from PIL import Image
from torch import nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from robust_lightning.cli import main
from robust_lightning.data.batch import Batch
from robust_lightning.training.lightning_module import ImageClassifier

if TYPE_CHECKING:
    from robust_lightning.data.sources import SyntheticSource

Config = dict[str, Any]  # a config (or a part of one) as its YAML file holds it

WNIDS = ("n01440764", "n01443537", "n15075141")  # ImageNet labels 0, 1 and 999
REPO = Path(__file__).resolve().parents[1]


def _read_terminal(master: int, chunks: list[bytes]) -> None:
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer has closed the terminal
            return
        if not data:
            return
        chunks.append(data)


def run_command(
    args: list[str],
    *,
    cwd: Path,
    timeout: float,
    terminal: bool = False,
    env: dict[str, str] | None = None,
    script: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m robust_lightning ARGS`` as a user would (or ``python SCRIPT ARGS``), in a session of its own.

    Every process it starts (DDP ranks, loader workers) is in that session: after ``timeout`` seconds all of them
    are killed with SIGKILL and the test fails, so a hang fails a test instead of stalling the suite (SIGTERM does
    not stop a hung Lightning run: it handles the signal). ``terminal``: standard output and error are a
    pseudo-terminal, as on a user's screen (progress bars drawn); their text comes back as ``stdout`` and
    ``stderr`` alike. ``tests/`` is on PYTHONPATH, so configs can name callbacks of helpers.py.
    """
    command = [sys.executable, *([str(script)] if script else ["-m", "robust_lightning"]), *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    options: dict[str, Any] = dict(cwd=cwd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    chunks: list[bytes] = []
    if terminal:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns (tqdm's width)
        process = subprocess.Popen(command, stdout=slave, stderr=slave, **options)
        os.close(slave)
        reader = threading.Thread(target=_read_terminal, args=(master, chunks), daemon=True)
        reader.start()
    else:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)
    try:
        if terminal:
            process.wait(timeout=timeout)
        else:
            stdout, stderr = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        stacks = stacks_of_session(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):  # after a timeout, or a rank or worker left behind
            os.killpg(process.pid, signal.SIGKILL)
        if terminal:
            reader.join(timeout=30)
            os.close(master)
            stdout = stderr = b"".join(chunks).decode(errors="replace")
    if timed_out:
        output = stdout if terminal else "".join(part or "" for part in process.communicate())
        pytest.fail(
            f"{' '.join(command[1:])} did not end within {timeout:.0f} s (killed with every "
            f"process it started):\n{output[-3000:]}\n\nwhere its processes were:\n{stacks}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def stacks_of_session(session: int) -> str:
    """Where each Python process of a session is (py-spy's dump of its threads), for the message of a command that
    hung: the stack of each process, or why there is none."""
    listed = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(session)], capture_output=True, text=True)
    spy = Path(sys.executable).with_name("py-spy")
    dumps = []
    for line in listed.stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        try:
            dump = subprocess.run([str(spy), "dump", "--pid", pid], capture_output=True, text=True, timeout=30)
            stack = dump.stdout or dump.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            stack = f"no stack: {e}"
        dumps.append(f"--- {pid} {args[:200]}\n{stack.strip()}")
    return "\n".join(dumps) or "no process of the session was left"


def write_image(path: Path, seed: int, size: int = 40, fmt: str = "JPEG") -> None:
    """A small image whose content depends on the seed (a coloured rectangle on a gradient)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0 : size + 8]
    image = np.stack([x * 4 % 256, y * 6 % 256, (x + y) * 3 % 256], -1).astype(np.uint8)
    x0, y0 = rng.integers(0, size // 2, 2)
    image[y0 : y0 + size // 3, x0 : x0 + size // 3] = rng.integers(0, 256, 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, format=fmt)


def make_image_tree(root: Path, per_class: dict[str, int], corrupt: Sequence[str] = ()) -> Path:
    """root/<wnid>/<wnid>_<i>.JPEG for each class; names in ``corrupt`` get bytes that are no image."""
    seed = 0
    for wnid, count in per_class.items():
        for i in range(count):
            write_image(root / wnid / f"{wnid}_{i}.JPEG", seed)
            seed += 1
    for name in corrupt:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg" + bytes(range(256)))
    return root


class KeyRecorder(Callback):
    """Writes the keys of every sample each rank trained / validated on to <out_dir>/<stage>-rank<r>-e<epoch>.json."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.keys: dict[str, list[str]] = {}

    def _record(self, stage: str, batch: Batch) -> None:
        self.keys.setdefault(stage, []).extend(batch["key"])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: STEP_OUTPUT, batch: Batch, batch_idx: int
    ) -> None:
        self._record("train", batch)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: STEP_OUTPUT,
        batch: Batch,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self._record("val", batch)

    def _dump(self, trainer: Trainer, stage: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{stage}-rank{trainer.global_rank}-e{trainer.current_epoch}.json"
        path.write_text(json.dumps(self.keys.pop(stage, [])))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._dump(trainer, "train")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._dump(trainer, "val")


class AugmentationRecorder(Callback):
    """Saves each training batch as the model got it (augmented images, labels, soft targets) to
    <out_dir>/rank<r>-e<epoch>-b<batch>.pt."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: dict[str, Any], batch_idx: int
    ) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        kept = {k: batch[k].clone() for k in ("image", "label", "target") if k in batch}
        torch.save(kept, self.out_dir / f"rank{trainer.global_rank}-e{trainer.current_epoch}-b{batch_idx}.pt")


# torch's TorchDispatchMode has no annotations: its __init_subclass__ and __init__ are untyped calls
class HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every op that reads tensor values back to the host (``.item()``, ``bool(t)``, ``nonzero``,
    boolean-mask indexing, ...): on a GPU each would wait for the device's queue to drain. Works on the CPU,
    so the test suite checks the GPU code paths without a GPU. ``calls`` holds (op, where it was called: 3
    frames, or the environment's HOSTREADS_DEPTH)."""

    _aten = torch.ops.aten
    READS: ClassVar[set[OpOverload]] = {
        _aten._local_scalar_dense.default,
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.bincount.default,
        _aten.equal.default,
        _aten.repeat_interleave.Tensor,
    }
    MASK_INDEXING: ClassVar[set[OpOverload]] = {
        _aten.index.Tensor,
        _aten.index_put.default,
        _aten.index_put_.default,
        _aten._index_put_impl_.default,
    }

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        reads = func in self.READS and not (func is self._aten.repeat_interleave.Tensor and kwargs.get("output_size"))
        if func in self.MASK_INDEXING:  # a boolean mask's nonzero entries become indices on the host
            reads = any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        if reads:
            depth = int(os.environ.get("HOSTREADS_DEPTH", "4"))
            self.calls.append((str(func), "".join(traceback.format_stack(limit=depth)[:-1])))
        return func(*args, **kwargs)

    def listing(self) -> str:
        return "reads back:\n" + "\n".join(f"{op}\n{where}" for op, where in self.calls)


def force_device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the attacks, the batched augmentation and the training step take, on the CPU, the path they take on GPUs
    (where reading values back is not cheap)."""
    for module in (
        "robust_lightning.attacks.projections",
        "robust_lightning.attacks.apgd",
        "robust_lightning.attacks.square",
        "robust_lightning.data.augment",
        "robust_lightning.training.lightning_module",
    ):
        monkeypatch.setattr(importlib.import_module(module), "host_reads_are_cheap", lambda t: False)


class AttackOutcome(Protocol):
    """What an attack of the package returns, as device_path_reads_nothing compares it."""

    @property
    def x_adv(self) -> torch.Tensor: ...

    @property
    def robust(self) -> torch.Tensor: ...


def device_path_reads_nothing(
    attack: Callable[[], AttackOutcome], monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, str]]:
    """Runs ``attack()`` (returning ``x_adv`` and ``robust``) on the CPU path, then on the device path: the latter
    must read nothing back and give the same result. Returns the CPU path's reads."""
    with HostReads() as cpu_path:
        expected = attack()
    force_device_path(monkeypatch)
    with HostReads() as device_path:
        result = attack()
    assert device_path.calls == [], device_path.listing()
    torch.testing.assert_close(result.x_adv, expected.x_adv)
    assert torch.equal(result.robust, expected.robust)
    reads: list[tuple[str, str]] = cpu_path.calls  # the mode's __enter__ is untyped
    return reads


def synthetic_points(n: int, seed: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """3 x 16 x 16 images: a class-specific smooth pattern plus noise, in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(
        torch.rand(classes, 3, 3, 3, generator=torch.Generator().manual_seed(99)),
        size=16,
        mode="bilinear",
        align_corners=False,
    )
    y = torch.randint(classes, (n,), generator=g)
    x = (0.25 + 0.5 * patterns[y] + 0.2 * torch.randn(n, 3, 16, 16, generator=g)).clamp(0, 1)
    return x, y


def train_small_cnn() -> nn.Module:
    """A small CNN trained (with FGSM-RS at a small radius, so that some points are robust) in a few seconds, in
    eval mode, on ``synthetic_points`` of 10 classes."""
    torch.manual_seed(0)
    model = nn.Sequential(  # with BatchNorm: the fast engine attacks a folded copy (checked against the reference)
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    x, y = synthetic_points(2048, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        index = torch.randint(len(x), (64,))
        xb, yb = x[index], y[index]
        delta = (torch.rand_like(xb) * 2 - 1) * 4 / 255
        delta.requires_grad_(True)
        (grad,) = torch.autograd.grad(F.cross_entropy(model(xb + delta), yb), delta)
        xb = (xb + (delta + 5 / 255 * grad.sign()).clamp(-4 / 255, 4 / 255)).clamp(0, 1).detach()
        optimizer.zero_grad()
        torch.autograd.backward(F.cross_entropy(model(xb), yb))
        optimizer.step()
    model.eval().requires_grad_(False)
    return model


# The folder in which tiny_config's shared synthetic datasets go, one per worker's session (tests/conftest.py)
SHARED_SYNTHETIC: Path | None = None


def synthetic_source(**options: Any) -> Config:
    """data.source for the built-in synthetic dataset with these options, as a config writes it."""
    return {"class_path": "SyntheticSource", "init_args": options}


def folder_source(root: Path | str, **options: Any) -> Config:
    """data.source for ImageFolder roots, as a config writes it."""
    return {"class_path": "FolderSource", "init_args": {"root": str(root), **options}}


def shard_source(**options: Any) -> Config:
    """data.source for WebDataset shards (train_shards, val_shards, train_size), as a config writes it."""
    return {
        "class_path": "ShardSource",
        "init_args": {k: str(v) if isinstance(v, Path) else v for k, v in options.items()},
    }


def tiny_config(tmp_path: Path, synthetic_root: Path | None = None, **overrides: Any) -> Path:
    """A tiny fit/validate/test config in ``tmp_path/tiny.yaml``: dotted ``overrides`` replace its values.

    ``synthetic_root`` None: the synthetic dataset these options give, shared by every test that reads the same
    (generated once per worker, in a folder of its own per set of options). A test that changes the files passes a
    folder of its own."""
    config: Config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "limit_train_batches": 3,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp_path / "runs"),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "runs"), "name": "tiny"},
            },
        },
        "model": {"arch": "convnext_atto_convstem", "warmup_epochs": 0.5, "lr": 1e-3},
        "data": {
            "source": synthetic_source(num_classes=4, train_per_class=8, val_per_class=4, image_size=32),
            "image_size": 32,
            "batch_size": 8,
            "num_workers": 0,
        },
    }
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    source = config["data"]["source"]
    if source["class_path"] == "SyntheticSource":
        synthetic = source["init_args"]
        if synthetic_root is None:  # a folder per set of options: tests with other options never replace it
            assert SHARED_SYNTHETIC is not None, "tests/conftest.py sets helpers.SHARED_SYNTHETIC"
            options = json.dumps(synthetic, sort_keys=True).encode()
            synthetic_root = SHARED_SYNTHETIC / hashlib.sha256(options).hexdigest()[:12]
        synthetic["root"] = str(synthetic_root)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def conversion_manifest(out: Path) -> dict[str, Any]:
    """The manifest of the shards in ``out`` without its time of writing: two conversions of the same source with
    the same options have equal ones."""
    manifest: dict[str, Any] = json.loads((out / "manifest.json").read_text())
    manifest.pop("created", None)
    return manifest


def fake_slurm_job(tmp_path: Path) -> dict[str, str]:
    """The environment SLURM gives a one-task batch job (Lightning then requeues it on SIGUSR1 and resumes it from its
    hpc checkpoint), with an ``scontrol`` that records the requeue in tmp_path/scontrol.log instead of asking a
    cluster. It then sends itself SIGTERM, as SLURM ends every process of a job it requeues, scontrol's own
    included. Merged over os.environ by the caller."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\nkill -TERM $$\n')
    scontrol.chmod(0o755)
    return {
        "PATH": f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "requeue-test",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }


def trainer_args(command: str, config: Path | str, options: dict[str, Any] | None = None) -> list[str]:
    """The arguments of a Trainer command for ``main``: ``command --config CONFIG --key value ...``, each option's
    value as text."""
    args = [command, "--config", str(config)]
    for key, value in (options or {}).items():
        args += [f"--{key}", str(value)]
    return args


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console entry point in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "robust_lightning", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


LINF = {"norm": "Linf", "eps": 4 / 255}


def eval_config(tmp_path: Path, synthetic_root: Path, devices: int = 1, **callback: Any) -> Path:
    config: Config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "max_epochs": 1,
            "limit_train_batches": 4,
            "num_sanity_val_steps": 0,
            "inference_mode": False,
            "default_root_dir": str(tmp_path / "runs"),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "runs"), "name": "aa"},
            },
            "callbacks": [
                {
                    "class_path": "robust_lightning.evaluation.autoattack.AutoAttackEvaluation",
                    "init_args": {
                        "threat_models": [LINF],
                        "version": "apgd-ce",
                        "n_iter": 5,
                        "results_dir": str(tmp_path / "outcomes"),
                        **callback,
                    },
                }
            ],
        },
        "model": {"arch": "test_resnet"},
        "data": {
            "source": synthetic_source(**TINY_SYNTHETIC, root=str(synthetic_root)),
            "image_size": 32,
            "batch_size": 8,
            "eval_batch_size": 6,
            "num_workers": 0,
        },
    }
    if devices > 1:
        config["trainer"]["strategy"] = "ddp"
    path = tmp_path / f"aa-{devices}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


TINY_SYNTHETIC = {"num_classes": 4, "train_per_class": 16, "val_per_class": 5, "samples_per_shard": 5, "image_size": 32}


def tiny_synthetic(root: Path) -> "SyntheticSource":
    from robust_lightning.data.sources import SyntheticSource

    return SyntheticSource(**TINY_SYNTHETIC, root=str(root))


def run_test(tmp_path: Path, checkpoint: tuple[Path, Path], *extra: str, **callback: Any) -> Config:
    ckpt, synthetic_root = checkpoint
    config = eval_config(tmp_path, synthetic_root, **callback)
    assert main(["test", "--config", str(config), "--ckpt_path", str(ckpt), *extra]) == 0
    runs = sorted((tmp_path / "runs" / "aa").glob("version_*/results.json"))
    section: Config = json.loads(runs[-1].read_text())["autoattack"]
    return section


# ------------------------------------------------------------------ the analyses' tiny models and configs
def tiny(arch: str, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(arch, num_classes=10, **kwargs).eval()


def tiny_vit(**kwargs: Any) -> torch.nn.Module:
    return tiny("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, **kwargs)


def two_epoch_fit(
    folder: Path,
    callback: dict[str, Any],
    stopped: Callable[[subprocess.CompletedProcess[str], Path], None] | None = None,
    stop_status: int = 143,
    **overrides: Any,
) -> Path:
    """A fit of test_resnet for two epochs of two steps in ``folder`` (tiny_config with ``overrides``), with
    ``callback``. With ``stopped``, the fit must end with ``stop_status`` (143: SIGTERM's, 130: Ctrl-C's) and no
    traceback, ``stopped(result, run)`` checks the stop, and the same command with ``--ckpt_path last`` finishes
    it. Returns the run directory.
    A user's progress bar (its line form: the output is a pipe) and a loader worker are on, which tiny_config
    turns off; W&B is not (tests/test_stop_anywhere.py's DDP fit checks its rows across stops)."""
    folder.mkdir()
    options = {"trainer.max_epochs": 2, "trainer.limit_train_batches": 2, "model.arch": "test_resnet"}
    options |= {"trainer.enable_progress_bar": True, "data.num_workers": 1}
    config = tiny_config(folder, **{**options, "trainer.callbacks": [callback], **overrides})
    command = ["fit", "--config", str(config)]
    done = run_command(command, cwd=folder, timeout=240)
    run = folder / "runs" / "tiny" / "version_0"
    if stopped is not None:
        assert done.returncode == stop_status, done.stderr[-3000:]
        assert "Traceback" not in done.stdout + done.stderr
        stopped(done, run)
        done = run_command([*command, "--ckpt_path", "last"], cwd=folder, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def untrained_checkpoint(tmp_path: Path, arch: str, **kwargs: Any) -> Path:
    from lightning import Trainer

    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(arch=arch, num_classes=10, image_size=32, **kwargs)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    path = tmp_path / f"{arch}.ckpt"
    trainer.save_checkpoint(path)
    return path


def shipped_analysis_config(tmp_path: Path, name: str, ckpt: Path, images: int = 8, **init_args: Any) -> Config:
    """configs/analysis/<name>.yaml as shipped, on a tiny checkpoint, small data, into tmp_path."""
    config: Config = yaml.safe_load((REPO / "configs" / "analysis" / f"{name}.yaml").read_text())
    config["ckpt_path"] = str(ckpt)
    config["trainer"] |= {"default_root_dir": str(tmp_path / "runs"), "enable_progress_bar": False}
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    config["trainer"]["callbacks"][0]["init_args"] |= {"max_images": images, "batch_size": images, **init_args}
    config["data"] |= {"eval_limit": images, "eval_batch_size": images, "num_workers": 0}
    config["data"]["source"]["init_args"] |= {
        "train_per_class": 1,
        "val_per_class": 1,
        "root": str(tmp_path / "synthetic"),
    }
    return config


def run_analysis(tmp_path: Path, config: Config, name: str = "run.yaml") -> tuple[int, Config | None, Path]:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    status = main(["test", "--config", str(path)])
    runs = sorted((tmp_path / "runs" / config["trainer"]["logger"]["init_args"]["name"]).glob("version_*"))
    written = runs[-1] / "results.json" if runs else None
    results: Config | None = json.loads(written.read_text()) if written and written.is_file() else None
    return status, results, runs[-1] if runs else tmp_path


# ------------------------------------------------------------------ checkpoints as Lightning writes them
def write_checkpoint(path: Path, **hparams: Any) -> ImageClassifier:
    """A training checkpoint as Lightning writes one (state_dict + hyper_parameters), untrained; the EMA copy
    (when there is one) is moved away from the raw weights so that exporting the wrong one shows."""
    torch.manual_seed(0)
    module = ImageClassifier(num_classes=5, **hparams).eval()
    if module.ema is not None:
        with torch.no_grad():
            for p in module.ema.module.parameters():
                p.add_(0.05 * torch.randn_like(p))
        module.ema.module.eval()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return module
