"""Every bad input a user can give, through the command line: one message naming the input and what was
expected, exit status 2, no traceback, for every subcommand. Inputs that are merely unusual (CMYK, grayscale, a
PNG named .JPEG, a very large image) run (exit 0); corrupt and zero-byte images and unlabelled shard samples
are skipped and counted.

Each probe runs ``robust_lightning.cli.main`` in this process: an exception escaping it (a traceback for the
user) fails the test."""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from helpers import WNIDS, make_image_tree, tiny_config, write_image
from robust_lightning.cli import main
from robust_lightning.models.classifier import build_classifier


@dataclass(frozen=True)
class Probe:
    name: str
    args: tuple[str, ...]  # "{w}": the probe world's folder, "{cfg}": its config (a tiny test_convnext run)
    status: int
    message: str  # a fragment of the error message (status 2) or of the run's output and log (status 0)
    metrics: dict = field(default_factory=dict)  # of results.json's validate section (status 0)


def ckpt_probes(command: str) -> list[Probe]:
    run = (command, "--config", "{cfg}", "--ckpt_path")
    expected = "expected a .ckpt file written by robust-lightning fit"
    return [
        Probe(
            f"{command} --ckpt_path missing",
            (*run, "{w}/nope.ckpt"),
            2,
            f"checkpoint not found: {{w}}/nope.ckpt; {expected}",
        ),
        Probe(
            f"{command} --ckpt_path empty",
            (*run, "{w}/empty.ckpt"),
            2,
            f"checkpoint {{w}}/empty.ckpt is empty (0 bytes); {expected}",
        ),
        Probe(
            f"{command} --ckpt_path truncated",
            (*run, "{w}/truncated.ckpt"),
            2,
            "cannot read checkpoint {w}/truncated.ckpt (truncated",
        ),
        Probe(f"{command} --ckpt_path a folder", (*run, "{w}"), 2, f"{{w}} is a directory; {expected}"),
        Probe(
            f"{command} --ckpt_path a weights file",
            (*run, "{w}/weights.pt"),
            2,
            "{w}/weights.pt is not a Lightning training checkpoint (no 'state_dict')",
        ),
    ]


def init_from_probes(command: str) -> list[Probe]:
    run = (command, "--config", "{cfg}", "--model.init_from")
    expected = "expected a checkpoint file (.ckpt, .pt/.pth or .safetensors)"
    return [
        Probe(
            f"{command} init_from missing",
            (*run, "{w}/nope.pt"),
            2,
            f"model.init_from: checkpoint not found: {{w}}/nope.pt; {expected}",
        ),
        Probe(
            f"{command} init_from empty",
            (*run, "{w}/empty.ckpt"),
            2,
            "model.init_from: checkpoint {w}/empty.ckpt is empty",
        ),
        Probe(
            f"{command} init_from truncated",
            (*run, "{w}/truncated.ckpt"),
            2,
            "model.init_from: cannot read checkpoint {w}/truncated.ckpt",
        ),
        Probe(f"{command} init_from a folder", (*run, "{w}"), 2, f"model.init_from: {{w}} is a directory; {expected}"),
        Probe(
            f"{command} init_from another architecture",
            (*run, "{w}/vit.pt"),
            2,
            "model.init_from: checkpoint {w}/vit.pt does not match the expected architecture 'test_convnext'",
        ),
    ]


def folder(root: str) -> tuple[str, ...]:
    return ("validate", "--config", "{cfg}", "--data.source", "FolderSource", "--data.source.root", f"{{w}}/{root}")


def shards(spec: str) -> tuple[str, ...]:
    return (
        "validate",
        "--config",
        "{cfg}",
        "--data.source",
        "ShardSource",
        "--data.source.val_shards",
        f"{{w}}/{spec}",
    )


PROBES = [
    # options and config files
    Probe("misspelt key", ("fit", "--config", "{cfg}", "--model.lrr", "0.1"), 2, "did you mean: model.lr"),
    Probe(
        "wrong type", ("fit", "--config", "{cfg}", "--trainer.max_epochs", "many"), 2, 'Parser key "trainer.max_epochs"'
    ),
    Probe("missing config", ("fit", "--config", "{w}/nope.yaml"), 2, "{w}/nope.yaml"),
    Probe("empty config", ("validate", "--config", "{w}/empty.yaml"), 2, "config file {w}/empty.yaml is empty"),
    Probe(
        "YAML syntax error", ("test", "--config", "{w}/broken.yaml"), 2, "config file {w}/broken.yaml is not valid YAML"
    ),
    # checkpoints given with --ckpt_path, for fit (resume) and an evaluation
    *ckpt_probes("fit"),
    *ckpt_probes("test"),
    Probe(
        "--ckpt_path of another label space",
        (*folder("imagenet"), "--ckpt_path", "{w}/last.ckpt"),
        2,
        "the checkpoint holds a 'test_convnext' model (num_classes 4",
    ),
    Probe(
        "--ckpt_path with another arch",
        ("validate", "--config", "{cfg}", "--ckpt_path", "{w}/last.ckpt", "--model.arch", "test_vit"),
        2,
        "--model.arch 'test_vit' conflicts with the checkpoint's arch 'test_convnext' ({w}/last.ckpt)",
    ),
    # warm-start files
    *init_from_probes("validate"),
    Probe(
        "fit init_from missing",
        ("fit", "--config", "{cfg}", "--model.init_from", "{w}/nope.pt"),
        2,
        "model.init_from: checkpoint not found: {w}/nope.pt",
    ),
    Probe(
        "predict init_from truncated",
        ("predict", "--config", "{cfg}", "--model.init_from", "{w}/truncated.ckpt"),
        2,
        "model.init_from: cannot read checkpoint {w}/truncated.ckpt",
    ),
    # data
    Probe("data root missing", folder("nowhere"), 2, "data.source.root {w}/nowhere does not exist"),
    Probe("wrong data layout", folder("flat"), 2, "{w}/flat/val does not exist; expected the ImageFolder layout"),
    Probe(
        "class folders that are not wnids", folder("pets"), 2, "class folders ['cat', 'dog'] are not in the class map"
    ),
    Probe("corrupt image", folder("corrupt"), 0, "bad.JPEG", {"val/num_images": 3, "val/corrupt_images": 1}),
    Probe("zero-byte image", folder("zero"), 0, "zero.JPEG", {"val/num_images": 3, "val/corrupt_images": 1}),
    Probe("PNG named .JPEG", folder("png"), 0, "", {"val/num_images": 4, "val/corrupt_images": 0}),
    Probe("CMYK image", folder("cmyk"), 0, "", {"val/num_images": 4, "val/corrupt_images": 0}),
    Probe("grayscale image", folder("gray"), 0, "", {"val/num_images": 4, "val/corrupt_images": 0}),
    Probe("very large image", folder("large"), 0, "", {"val/num_images": 4, "val/corrupt_images": 0}),
    Probe(
        "truncated shard",
        shards("truncated_shards"),
        2,
        "{w}/truncated_shards: shard(s) truncated or changed since they were written: val-000000.tar (1500 bytes",
    ),
    Probe(
        "truncated shard without a manifest",
        shards("cut/val-{{000000..000000}}.tar"),
        2,
        "cannot read shard (ReadError: unexpected end of data @ <_io.BufferedReader name='{w}/cut/val-000000.tar'>)",
    ),
    Probe(
        "shard sample without a label",
        shards("unlabelled/val-{{000000..000000}}.tar"),
        0,
        "missing or invalid 'cls' label",
        {"val/num_images": 1, "val/corrupt_images": 1},
    ),
    # tools
    Probe(
        "export missing", ("export", "{w}/nope.ckpt", "{w}/out.safetensors"), 2, "checkpoint not found: {w}/nope.ckpt"
    ),
    Probe("export empty", ("export", "{w}/empty.ckpt", "{w}/out.safetensors"), 2, "checkpoint {w}/empty.ckpt is empty"),
    Probe(
        "export truncated",
        ("export", "{w}/truncated.ckpt", "{w}/out.safetensors"),
        2,
        "cannot read checkpoint {w}/truncated.ckpt",
    ),
    Probe(
        "export a weights file",
        ("export", "{w}/weights.pt", "{w}/out.safetensors"),
        2,
        "{w}/weights.pt is not a robust-lightning training checkpoint",
    ),
    Probe("sweep file missing", ("sweep", "--config", "{w}/nope-sweep.yaml", "--dry_run"), 2, "{w}/nope-sweep.yaml"),
    Probe(
        "sweep file empty",
        ("sweep", "--config", "{w}/empty.yaml", "--dry_run"),
        2,
        "config file {w}/empty.yaml is empty",
    ),
    Probe("shards source missing", ("shards", "{w}/nowhere", "{w}/shards_out"), 2, "{w}/nowhere"),
    # outputs that cannot be written (as root, permission bits stop nothing: a file where a folder is needed and
    # /proc, which holds no files, stand for read-only places; tests/test_writers.py fills a tiny disk)
    Probe(
        "checkpoints under a file",
        ("fit", "--config", "{cfg}", "--checkpoint.dirpath", "{w}/empty.yaml/ckpts"),
        2,
        "cannot create {w}/empty.yaml/ckpts: a part of that path is a file, not a folder",
    ),
    Probe(
        "checkpoints under /proc",
        ("fit", "--config", "{cfg}", "--checkpoint.dirpath", "/proc/rl-probe/ckpts"),
        2,
        "cannot use /proc/rl-probe",
    ),
    Probe(
        "run directory under a file",
        (
            "validate",
            "--config",
            "{cfg}",
            "--ckpt_path",
            "{w}/last.ckpt",
            "--trainer.logger.init_args.save_dir",
            "{w}/empty.yaml/runs",
        ),
        2,
        "{w}/empty.yaml",
    ),
    Probe("export under a file", ("export", "{w}/last.ckpt", "{w}/empty.yaml/model.safetensors"), 2, "{w}/empty.yaml"),
    Probe(
        "export folder under /proc", ("export", "{w}/last.ckpt", "/proc/rl-probe/model"), 2, "cannot use /proc/rl-probe"
    ),
    Probe("shards into /proc", ("shards", "{w}/imagenet/val", "/proc/rl-probe/shards"), 2, "/proc/rl-probe"),
]


def image_tree(root: Path) -> Path:
    """val/ of three ImageNet classes, one image each."""
    return make_image_tree(root / "val", {wnid: 1 for wnid in WNIDS})


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("probes")
    config = tiny_config(w, **{"model.arch": "test_convnext", "trainer.limit_train_batches": 1})
    assert main(["fit", "--config", str(config)]) == 0
    checkpoint = w / "last.ckpt"
    shutil.copy(w / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt", checkpoint)
    (w / "truncated.ckpt").write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    (w / "empty.ckpt").write_bytes(b"")
    torch.save(build_classifier("test_convnext", 4).net.state_dict(), w / "weights.pt")
    torch.save(build_classifier("test_vit", 4, image_size=32).net.state_dict(), w / "vit.pt")
    (w / "empty.yaml").write_text("# nothing but a comment\n")
    (w / "broken.yaml").write_text("model:\n  arch: [test_convnext\n")

    make_image_tree(w / "imagenet" / "val", {wnid: 1 for wnid in WNIDS})
    (w / "flat" / "images").mkdir(parents=True)
    make_image_tree(w / "pets" / "val", {"cat": 1, "dog": 1})
    image_tree(w / "corrupt")
    (w / "corrupt" / "val" / WNIDS[0] / "bad.JPEG").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    (image_tree(w / "zero") / WNIDS[0] / "zero.JPEG").write_bytes(b"")
    write_image(image_tree(w / "png") / WNIDS[0] / "png.JPEG", seed=7, fmt="PNG")
    Image.new("CMYK", (40, 48), (10, 200, 30, 5)).save(image_tree(w / "cmyk") / WNIDS[0] / "cmyk.JPEG", format="JPEG")
    Image.new("L", (40, 48), 128).save(image_tree(w / "gray") / WNIDS[0] / "gray.JPEG", format="JPEG")
    y, x = np.mgrid[0:3000, 0:4000]  # 12 megapixels, as large as ImageNet's largest photographs
    large = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    Image.fromarray(large).save(image_tree(w / "large") / WNIDS[0] / "large.JPEG", quality=80)

    assert (
        main(
            [
                "shards",
                str(image_tree(w / "for_shards")),
                str(w / "truncated_shards"),
                "--samples_per_shard",
                "2",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    shard = w / "truncated_shards" / "val-000000.tar"
    shard.write_bytes(shard.read_bytes()[:1500])  # cut inside its first sample's image
    (w / "cut").mkdir()  # cut inside an image: tarfile finds the end of data missing
    noise = np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)
    Image.fromarray(noise).save(w / "noise.jpg", quality=95)
    with wds.TarWriter(str(w / "cut" / "val-000000.tar")) as sink:
        sink.write({"__key__": "noise", "jpg": (w / "noise.jpg").read_bytes(), "cls": 0})
    cut = w / "cut" / "val-000000.tar"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (w / "unlabelled").mkdir()
    write_image(w / "image.jpg", seed=3)
    with wds.TarWriter(str(w / "unlabelled" / "val-000000.tar")) as sink:
        sink.write({"__key__": "labelled", "jpg": (w / "image.jpg").read_bytes(), "cls": 0})
        sink.write({"__key__": "unlabelled", "jpg": (w / "image.jpg").read_bytes()})
    return w


def test_every_probe_is_listed_once():
    names = [probe.name for probe in PROBES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("probe", PROBES, ids=lambda probe: probe.name)
def test_probe(probe: Probe, world, tmp_path, capsys, caplog):
    fill = {"w": str(world), "cfg": str(world / "tiny.yaml")}
    args = [arg.format(**fill) for arg in probe.args]
    if args[0] in ("fit", "validate", "test", "predict") and "--trainer.logger.init_args.save_dir" not in args:
        args += ["--trainer.logger.init_args.save_dir", str(tmp_path)]
    try:
        status = main(args)
    except SystemExit as e:  # the argument parser exits by itself
        status = e.code
    captured = capsys.readouterr()
    output = captured.out + captured.err + caplog.text
    assert status == probe.status, output[-3000:]
    assert probe.message.format(**fill) in output, output[-3000:]
    assert "Traceback" not in output
    if probe.status == 2:
        assert captured.err.count("error:") == 1, captured.err[-3000:]  # one message, not a cascade
    if probe.metrics:
        metrics = json.loads(next(tmp_path.glob("tiny/version_*/results.json")).read_text())["validate"]["metrics"]
        assert {key: metrics[key] for key in probe.metrics} == probe.metrics
