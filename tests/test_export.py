"""robust-lightning export to a timm model folder: plain timm, in a process that never imports robust_lightning,
loads it with timm.create_model("local-dir:...") and gives our model's logits on the same [0, 1] images."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from helpers import write_checkpoint
from robust_lightning.cli import main

# Runs in a fresh interpreter: only timm, preprocessing exactly as timm's data config of the folder says.
PLAIN_TIMM = textwrap.dedent(
    """
    import json, sys
    import torch, timm

    folder, images, out = sys.argv[1:]
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    config = timm.data.resolve_model_data_config(model)
    x = torch.load(images, weights_only=True)
    mean = torch.tensor(config["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(config["std"]).view(1, -1, 1, 1)
    with torch.no_grad():
        logits = model((x - mean) / std)
    assert "robust_lightning" not in sys.modules, "plain timm must not need robust_lightning"
    json.dump({"logits": logits.tolist(), "config": {k: config[k] for k in ("input_size", "mean", "std",
              "interpolation", "crop_pct")}}, open(out, "w"))
    """
)


def load_with_plain_timm(folder: Path, x: torch.Tensor, tmp_path: Path) -> dict:
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_TIMM, str(folder), str(tmp_path / "x.pt"), str(tmp_path / "out.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.parametrize(
    "hparams, ema",
    [
        # a normaliser with its own mean/std, the raw weights
        (dict(arch="test_resnet", image_size=32, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3)), False),
        # a net on raw [0, 1] images (no normaliser), a ViT built for 32 px, its EMA weights
        (dict(arch="test_vit", image_size=32, mean=None, std=None, ema_decay=0.9), True),
    ],
)
def test_timm_folder_loads_in_plain_timm_and_gives_our_logits(tmp_path, capsys, hparams, ema):
    module = write_checkpoint(tmp_path / "m.ckpt", **hparams)
    folder = tmp_path / "exported"
    assert main(["export", str(tmp_path / "m.ckpt"), str(folder), *(["--ema"] if ema else [])]) == 0
    assert f'timm.create_model("local-dir:{folder}", pretrained=True)' in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == hparams["arch"] and config["num_classes"] == 5
    assert "tag" not in config["pretrained_cfg"]  # not timm's release of the architecture

    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = (module.ema.module if ema else module.model)(x)
        raw = module.model(x)
    loaded = load_with_plain_timm(folder, x, tmp_path)
    assert torch.allclose(torch.tensor(loaded["logits"]), expected, atol=1e-5)
    if ema:  # the EMA weights, not the raw ones
        assert not torch.allclose(expected, raw, atol=1e-3)
    mean, std = (hparams["mean"], hparams["std"]) if hparams["mean"] else ((0.0,) * 3, (1.0,) * 3)
    assert loaded["config"]["mean"] == pytest.approx(mean) and loaded["config"]["std"] == pytest.approx(std)
    assert loaded["config"]["input_size"] == [3, 32, 32]
    assert loaded["config"]["interpolation"] == "bicubic" and loaded["config"]["crop_pct"] == 0.875


def test_export_takes_its_options_from_a_config_file(tmp_path, capsys):
    module = write_checkpoint(tmp_path / "m.ckpt", arch="test_resnet", image_size=32, ema_decay=0.9)
    options = tmp_path / "export.yaml"
    options.write_text(
        yaml.safe_dump({"checkpoint": str(tmp_path / "m.ckpt"), "out": str(tmp_path / "w.safetensors"), "ema": True})
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--config", str(options), "--print_config"])
    assert exit_info.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out) == {
        "checkpoint": str(tmp_path / "m.ckpt"),
        "out": str(tmp_path / "w.safetensors"),
        "ema": True,
    }
    assert main(["export", "--config", str(options)]) == 0
    assert "wrote EMA weights" in capsys.readouterr().out
    from robust_lightning.models.checkpoints import read_state_dict

    exported = read_state_dict(tmp_path / "w.safetensors")
    for key, value in module.ema.module.net.state_dict().items():
        assert torch.equal(exported[key], value), key


def test_folder_of_a_project_architecture_says_it_needs_robust_lightning(tmp_path, capsys):
    write_checkpoint(tmp_path / "m.ckpt", arch="convnext_atto_convstem", image_size=32)
    assert main(["export", str(tmp_path / "m.ckpt"), str(tmp_path / "folder")]) == 0
    err = capsys.readouterr().err
    assert "convnext_atto_convstem" in err and "import robust_lightning" in err
    assert json.loads((tmp_path / "folder" / "config.json").read_text())["architecture"] == "convnext_atto_convstem"


def test_small_input_model_is_refused_as_a_folder(tmp_path, capsys):
    write_checkpoint(tmp_path / "m.ckpt", arch="test_convnext", image_size=32, small_input=True)
    assert main(["export", str(tmp_path / "m.ckpt"), str(tmp_path / "folder")]) == 2
    assert "small_input" in capsys.readouterr().err and not (tmp_path / "folder").exists()


def test_the_folder_has_a_model_card_with_the_numbers_measured_on_that_checkpoint(tmp_path):
    """README.md of the folder: architecture, input, recipe, and the numbers of the results.json files that name
    the checkpoint by its sha256 (a run dir beside the checkpoints folder, as the quickstart has); others not."""
    from robust_lightning.evaluation.results import file_sha256

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    write_checkpoint(
        checkpoints / "last.ckpt",
        arch="test_resnet",
        image_size=32,
        mean=(0.4, 0.5, 0.6),
        std=(0.2, 0.25, 0.3),
        attack="apgd",
        attack_eps=4 / 255,
        attack_steps=2,
    )
    named = {"path": str(checkpoints / "last.ckpt"), "sha256": file_sha256(checkpoints / "last.ckpt")}
    (tmp_path / "run" / "version_0").mkdir()
    (tmp_path / "run" / "version_0" / "results.json").write_text(
        json.dumps(
            {
                "fit": {"metrics": {"val/acc1": 0.625, "val/robust_acc": 0.5}, "last_checkpoint": named},
                "autoattack": {
                    "threat_models": {
                        "Linf-4_255": {"num_points": 16, "clean_accuracy": 0.625, "robust_accuracy": 0.4375}
                    },
                    "conditions": {"version": "standard", "precision": "fp32 (TF32 off)"},
                },
            }
        )
    )
    (tmp_path / "run" / "version_1").mkdir()  # another checkpoint's run: not reported
    (tmp_path / "run" / "version_1" / "results.json").write_text(
        json.dumps({"test": {"metrics": {"test/acc1": 0.99}, "checkpoint": {**named, "sha256": "0" * 64}}})
    )
    assert main(["export", str(checkpoints / "last.ckpt"), str(tmp_path / "folder")]) == 0
    card = (tmp_path / "folder" / "README.md").read_text()
    assert card.startswith("# test_resnet: raw weights exported by robust-lightning")
    assert "Normalise [0, 1] images with mean [0.4, 0.5, 0.6] and std [0.2, 0.25, 0.3]" in card
    assert "Adversarial training: apgd, Linf eps 4/255, 2 steps." in card
    assert f"From `{tmp_path / 'run' / 'version_0' / 'results.json'}`" in card
    assert "- fit: val/acc1 62.50 %, val/robust_acc 50.00 %" in card
    assert "| Linf-4_255 | 16 | 62.50 | 43.75 |" in card and "standard, fp32 (TF32 off)" in card
    assert "99.00" not in card and "version_1" not in card

    # a recipe's layout: runs/at/<recipe>/best.ckpt with its runs in runs/at/<recipe>/version_N
    recipe = tmp_path / "at" / "recipe"
    (recipe / "version_0").mkdir(parents=True)
    write_checkpoint(recipe / "best.ckpt", arch="test_resnet", image_size=32)
    (recipe / "version_0" / "results.json").write_text(
        json.dumps(
            {"fit": {"metrics": {"val/acc1": 0.5}, "best_checkpoint": {"sha256": file_sha256(recipe / "best.ckpt")}}}
        )
    )
    assert main(["export", str(recipe / "best.ckpt"), str(tmp_path / "recipe_folder")]) == 0
    assert "- fit: val/acc1 50.00 %" in (tmp_path / "recipe_folder" / "README.md").read_text()

    alone = tmp_path / "alone.ckpt"
    write_checkpoint(alone, arch="test_resnet", image_size=32)
    assert main(["export", str(alone), str(tmp_path / "alone")]) == 0
    card = (tmp_path / "alone" / "README.md").read_text()
    assert "takes [0, 1] images as they are" in card and "no numbers are reported here" in card


def test_an_export_cut_short_leaves_the_earlier_export_in_the_folder_as_it_was(tmp_path, monkeypatch, capsys):
    """A second export into the same folder, stopped by Ctrl-C or SIGTERM (sent to this process: the command runs
    in it) half-way through writing the weights, or failing on a full disk: the folder holds the first export byte
    for byte (a user's own file in it too) and nothing of the second, and no staging folder is left in it or beside
    it. The same command then replaces the files with the second export's."""
    import safetensors.torch

    write_checkpoint(tmp_path / "first.ckpt", arch="test_resnet", image_size=32)
    module = write_checkpoint(tmp_path / "second.ckpt", arch="test_resnet", image_size=32)
    with torch.no_grad():  # other weights than the first checkpoint's
        for parameter in module.parameters():
            parameter.add_(0.1)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "second.ckpt")
    folder = tmp_path / "exported"
    assert main(["export", str(tmp_path / "first.ckpt"), str(folder)]) == 0
    (folder / "notes.txt").write_text("mine")
    first = {path.name: path.read_bytes() for path in folder.iterdir()}
    write_whole_file = safetensors.torch.save_file

    def cut_short(stop):
        def save_file(tensors, filename, metadata=None):
            Path(filename).write_bytes(safetensors.torch.save(tensors, metadata=metadata)[:100])
            stop()

        return save_file

    def ctrl_c():
        raise KeyboardInterrupt

    def sigterm():
        os.kill(os.getpid(), signal.SIGTERM)

    def full_disk():
        raise OSError(28, "No space left on device")

    for stop, status, message in [
        (ctrl_c, 130, "export interrupted by Ctrl-C"),
        (sigterm, 143, "export stopped by SIGTERM"),
        (full_disk, 2, f"cannot write into {folder}: No space left on device"),
    ]:
        monkeypatch.setattr(safetensors.torch, "save_file", cut_short(stop))
        assert main(["export", str(tmp_path / "second.ckpt"), str(folder)]) == status
        assert message in capsys.readouterr().err
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == first
        assert sorted(path.name for path in tmp_path.iterdir()) == ["exported", "first.ckpt", "second.ckpt"]

    monkeypatch.setattr(safetensors.torch, "save_file", write_whole_file)
    assert main(["export", str(tmp_path / "second.ckpt"), str(folder)]) == 0
    from robust_lightning.atomic import umask

    second = module.model.net.state_dict()
    exported = safetensors.torch.load_file(folder / "model.safetensors")
    assert exported.keys() == second.keys() and all(torch.equal(exported[k], second[k]) for k in second)
    assert (folder / "notes.txt").read_text() == "mine"
    assert (folder / "config.json").read_bytes() == first["config.json"]  # the same architecture
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask()
