"""ImageNet-P: flip probability and top-5 distance against hand and brute-force computations, the AlexNet
normalisation, layout errors, and runs of the callback on a tiny replica of videos written here (end to end
against an independent decode, a corrupt video skipped and named, DDP over two processes, the CLI config)."""

import csv
import itertools
import json
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.loggers import WandbLogger
from PIL import Image

from helpers import REPO, make_image_tree, run_command
from robust_lightning.errors import UserError
from robust_lightning.evaluation.imagenet_p import (
    ALL,
    TEST,
    VALIDATION,
    ImageNetP,
    alexnet_flip_probabilities,
    flip_probability,
    imagenet_p_sequences,
    perturbation_summary,
    top5_distance,
)
from robust_lightning.paths import DATA_DIR
from shift_data import SIZE, frames_of, imagenet_p_tree, write_video

WNIDS = ("n01440764", "n01443537", "n15075141")  # ImageNet labels 0, 1, 999
LAYOUT = r"<root>/<perturbation>/<wnid>/<sequence>\.mp4"


# ------------------------------------------------------------------------------------ independent references
def brute_force_flips(predictions: list[int], noise: bool, difficulty: int = 1) -> float:
    """The reference's loops: for noise every frame against the first; otherwise chains of every d-th frame
    (starting at 0 .. d-1), each frame against the previous one in its chain."""
    flips = []
    if noise:
        flips = [int(p != predictions[0]) for p in predictions[1:]]
    else:
        for start in range(difficulty):
            chain = predictions[start::difficulty]
            flips += [int(a != b) for a, b in itertools.pairwise(chain)]
    return sum(flips) / len(flips)


def ranked_classes(logits: list[float]) -> list[int]:
    """Classes best first; ties: the lower class index first (ordinal ranking)."""
    return sorted(range(len(logits)), key=lambda c: (-logits[c], c))


def brute_force_pair_distance(earlier: list[float], later: list[float]) -> int:
    """The paper's definition: sum_{i=1..5} sum_{j=min(i,s(i))+1}^{max(i,s(i))} 1(1 <= j-1 <= 5), s(i) = the rank in
    the later frame of the earlier frame's i-th class."""
    first, second = ranked_classes(earlier), ranked_classes(later)
    total = 0
    for i in range(1, 6):
        s = second.index(first[i - 1]) + 1
        total += sum(1 for j in range(min(i, s) + 1, max(i, s) + 1) if 1 <= j - 1 <= 5)
    return total


def brute_force_t5d(logits: list[list[float]], noise: bool, difficulty: int = 1) -> float:
    if noise:
        distances = [brute_force_pair_distance(logits[0], frame) for frame in logits[1:]]
    else:
        distances = [
            brute_force_pair_distance(a, b)
            for start in range(difficulty)
            for a, b in zip(logits[start::difficulty], logits[start::difficulty][1:])
        ]
    return sum(distances) / len(distances)


# --------------------------------------------------------------------------------------------------- metrics
def test_flip_probability_on_a_constructed_sequence():
    predictions = torch.tensor([3, 3, 5, 5, 3, 7, 7, 3])
    # consecutive: 3-3 no, 3-5 yes, 5-5 no, 5-3 yes, 3-7 yes, 7-7 no, 7-3 yes: 4 flips in 7 pairs
    assert flip_probability(predictions, first_frame=False).item() == pytest.approx(4 / 7, abs=1e-15)
    # noise rule: against frame 0 (class 3): 3 no, 5 yes, 5 yes, 3 no, 7 yes, 7 yes, 3 no: 4 in 7
    assert flip_probability(predictions, first_frame=True).item() == pytest.approx(4 / 7, abs=1e-15)
    other = torch.tensor([3, 5, 5, 5, 5, 5, 5, 5])  # one flip early: the two rules now disagree
    assert flip_probability(other, first_frame=False).item() == pytest.approx(1 / 7, abs=1e-15)
    assert flip_probability(other, first_frame=True).item() == pytest.approx(7 / 7, abs=1e-15)
    # difficulty 2 (frames two apart): (0,2) 3-5 (1,3) 3-5 (2,4) 5-3 (3,5) 5-7 (4,6) 3-7 (5,7) 7-3: 6 in 6
    assert flip_probability(predictions, first_frame=False, step=2).item() == 1.0
    # a batch of sequences gives one value per sequence
    batch = flip_probability(torch.stack([predictions, other]), first_frame=False)
    assert batch.tolist() == pytest.approx([4 / 7, 1 / 7], abs=1e-15)
    rng = np.random.default_rng(0)
    for noise, difficulty in ((True, 1), (False, 1), (False, 2), (False, 3)):
        sequence = rng.integers(0, 3, 31).tolist()
        assert flip_probability(torch.tensor(sequence), noise, 1 if noise else difficulty).item() == pytest.approx(
            brute_force_flips(sequence, noise, difficulty), abs=1e-15
        )


def test_top5_distance_by_hand():
    base = torch.arange(20, 0, -1).float()  # class c ranked c + 1
    same = torch.stack([base, base])
    assert top5_distance(same, first_frame=False).item() == 0
    swapped = base.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # top-1 and top-2 trade places: |1-2| + |2-1|
    assert top5_distance(torch.stack([base, swapped]), first_frame=False).item() == 2
    dropped = base.clone()
    dropped[0] = -1.0  # the top class falls to the last rank (clipped to 6): 5, and four classes move up by 1
    assert top5_distance(torch.stack([base, dropped]), first_frame=False).item() == 9
    tied = base.clone()
    tied[1] = tied[0]  # a tie: the lower class index ranks first, so nothing moves
    assert top5_distance(torch.stack([base, tied]), first_frame=False).item() == 0
    # noise rule: both later frames against the first: (2 + 9) / 2. Consecutive: the second pair is swapped ->
    # dropped, where swapped ranks 1, 0, 2, 3, 4 and dropped ranks 1, 2, 3, 4, 5, ..., 0: s = 1, 20 (clipped to
    # 6), 2, 3, 4, so 0 + 4 + 1 + 1 + 1 = 7
    sequence = torch.stack([base, swapped, dropped])
    assert top5_distance(sequence, first_frame=True).item() == (2 + 9) / 2
    assert top5_distance(sequence, first_frame=False).item() == (2 + 7) / 2
    assert brute_force_pair_distance(swapped.tolist(), dropped.tolist()) == 7  # the brute force agrees


@pytest.mark.parametrize("noise,difficulty", [(True, 1), (False, 1), (False, 2)])
def test_top5_distance_matches_a_brute_force_loop(noise, difficulty):
    rng = np.random.default_rng(difficulty + 10 * noise)
    # few distinct values over 50 classes: many ties, so the ordinal tie rule matters
    logits = torch.from_numpy(rng.integers(0, 12, (3, 9, 50)).astype(np.float32))
    mine = top5_distance(logits, first_frame=noise, step=difficulty)
    expected = [brute_force_t5d(sequence.tolist(), noise, difficulty) for sequence in logits]
    assert mine.tolist() == pytest.approx(expected, abs=1e-12)
    assert len(set(expected)) > 1  # the check discriminates


# ------------------------------------------------------------------------------------------------ AlexNet FR
def test_alexnet_constants_and_flip_rate_normalisation():
    with open(DATA_DIR / "imagenet_p_alexnet_flip_probs.csv", newline="") as f:
        rows = {row["perturbation"]: float(row["alexnet_flip_prob"]) for row in csv.DictReader(f)}
    assert alexnet_flip_probabilities() == rows and sorted(rows) == sorted(ALL) and len(ALL) == 14
    assert rows["scale"] == 0.23531 and rows["gaussian_noise"] == 0.23653
    scores = {p: {"fp": 0.01 * (i + 1), "t5d": 0.1 * (i + 1)} for i, p in enumerate(ALL)}
    result = perturbation_summary(scores)
    fr = [0.01 * (i + 1) / rows[p] for i, p in enumerate(TEST)]
    assert [result["fr"][p] for p in TEST] == pytest.approx(fr, abs=1e-12)
    assert result["mfr"] == pytest.approx(sum(fr) / 10, abs=1e-12)
    assert result["mt5d"] == pytest.approx(sum(0.1 * (i + 1) for i in range(10)) / 10, abs=1e-12)
    validation_fr = [0.01 * (11 + i) / rows[p] for i, p in enumerate(VALIDATION)]
    assert result["validation"]["mfr"] == pytest.approx(sum(validation_fr) / 4, abs=1e-12)
    assert result["validation"]["perturbations"] == list(VALIDATION)
    # AlexNet's own flip probabilities give FR 1
    assert perturbation_summary({p: {"fp": rows[p], "t5d": 1.0} for p in TEST})["mfr"] == pytest.approx(1.0)
    # fewer than the 10: a different key; difficulty 2 has no AlexNet constants
    partial = perturbation_summary({p: scores[p] for p in ("snow", "tilt")})
    assert "mfr" not in partial and partial["mfr_partial"]["perturbations"] == ["snow", "tilt"]
    assert partial["mfr_partial"]["value"] == pytest.approx((0.05 / rows["snow"] + 0.09 / rows["tilt"]) / 2)
    assert "validation" not in partial
    assert perturbation_summary({"snow": scores["snow"]}, difficulty=2)["fr"] == {"snow": None}


# ------------------------------------------------------------------------------------------------- replicas


def decode(path: Path) -> torch.Tensor:
    """Frames as the test reads them, independently of the module: (frames, 3, H, W) in [0, 1]."""
    if path.is_dir():
        images = [np.array(Image.open(path / f"img{i}.png")) for i in range(len(list(path.iterdir())))]
    else:
        capture, images = cv2.VideoCapture(str(path)), []
        while (frame := capture.read())[0]:
            images.append(cv2.cvtColor(frame[1], cv2.COLOR_BGR2RGB))
        capture.release()
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


class PoolModel(torch.nn.Module):
    """Stands in for the LightningModule: a fixed random linear map of 4 x 4 average-pooled pixels to 1000
    logits; records the shape of every input batch."""

    def __init__(self, image_size: int = SIZE):
        super().__init__()
        self.hparams = {"image_size": image_size}
        self.weight = torch.randn(48, 1000, generator=torch.Generator().manual_seed(0))
        self.shapes: list[tuple[int, ...]] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(images.shape))
        return torch.nn.functional.adaptive_avg_pool2d(images, 4).flatten(1) @ self.weight


class FakeWandb(WandbLogger):
    """A WandbLogger that records what it is given (no wandb run)."""

    def __init__(self):
        self.metrics, self.images = {}, {}

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_image(self, key, images, step=None, **kwargs):
        self.images[key] = images


def fake_trainer(
    run_dir: Path, world_size: int = 1, rank: int = 0, loggers=(), barrier=lambda: None
) -> SimpleNamespace:
    """``barrier``: the strategy's, which the ranks of the thread test below must really wait in: the prediction
    loop's ranks all read the saved rows before any rank adds its own."""
    return SimpleNamespace(
        world_size=world_size,
        global_rank=rank,
        is_global_zero=rank == 0,
        log_dir=str(run_dir),
        default_root_dir=str(run_dir),  # where the prediction rows are kept (run_dir/predictions)
        precision="32-true",
        strategy=SimpleNamespace(barrier=barrier),
        loggers=list(loggers),
        global_step=0,
        ckpt_path=None,
        datamodule=None,
        precision_plugin=SimpleNamespace(test_step_context=nullcontext),
    )


def run_callback(root: Path, run_dir: Path, model: torch.nn.Module, loggers=(), **kwargs) -> dict:
    kwargs = {"plot": False, **kwargs}
    callback = ImageNetP(
        root=str(root),
        perturbations=["gaussian_noise", "brightness", "speckle_noise"],
        batch_size=2,
        num_workers=0,
        **kwargs,
    )
    trainer = fake_trainer(run_dir, loggers=loggers)
    callback.on_test_start(trainer, model)
    callback.on_test_end(trainer, model)
    return json.loads((run_dir / "results.json").read_text())["imagenet_p"]


# -------------------------------------------------------------------------------------------------- layouts
def test_layout_errors_name_the_expected_layout(tmp_path):
    with pytest.raises(UserError, match=rf"nowhere does not exist; expected {LAYOUT}"):
        imagenet_p_sequences(tmp_path / "nowhere", ["snow"])
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    with pytest.raises(UserError, match=rf"no perturbation folders; expected {LAYOUT}"):
        imagenet_p_sequences(tmp_path / "empty", ["snow"])
    root = tmp_path / "p"
    write_video(root / "snow" / WNIDS[0] / "a.mp4", frames_of(0, 3))
    with pytest.raises(UserError, match=rf"perturbation folders \['tilt'\] not found .*expected {LAYOUT}"):
        imagenet_p_sequences(root, ["snow", "tilt"])
    with pytest.raises(UserError, match=r"perturbation folders \['gaussian_noise_2'\] not found"):
        imagenet_p_sequences(root, ["gaussian_noise"], difficulty=2)  # noise difficulties have their own folders
    assert imagenet_p_sequences(root, ["snow"], difficulty=2) == {"snow": [str(root / "snow" / WNIDS[0] / "a.mp4")]}
    (root / "snow" / "n00000000").mkdir()
    with pytest.raises(UserError, match=rf"unknown wnid folders \['n00000000'\]; expected {LAYOUT}"):
        imagenet_p_sequences(root, ["snow"])
    (root / "snow" / "n00000000").rmdir()
    (root / "tilt" / WNIDS[1]).mkdir(parents=True)
    (root / "tilt" / WNIDS[1] / "notes.txt").write_text("no videos here")
    with pytest.raises(UserError, match=rf"holds no \.mp4 sequences; expected {LAYOUT}"):
        imagenet_p_sequences(root, ["tilt"])
    with pytest.raises(UserError, match="unknown"):
        ImageNetP(root=str(root), perturbations=["snowy"])
    with pytest.raises(UserError, match="difficulty"):
        ImageNetP(root=str(root), difficulty=4)


def test_subsampling_is_evenly_spaced_and_frame_folders_count_as_sequences(tmp_path):
    root = tmp_path / "p"
    for i in range(6):
        write_video(root / "rotate" / WNIDS[i % 2] / f"v{i}.mp4", frames_of(i, 2))
    (root / "rotate" / WNIDS[2] / "seq").mkdir(parents=True)
    found = imagenet_p_sequences(root, ["rotate"])["rotate"]
    assert [Path(p).name for p in found] == ["v0.mp4", "v2.mp4", "v4.mp4", "v1.mp4", "v3.mp4", "v5.mp4", "seq"]
    capped = imagenet_p_sequences(root, ["rotate"], max_per_perturbation=3)["rotate"]
    assert [Path(p).name for p in capped] == ["v0.mp4", "v4.mp4", "v3.mp4"]  # positions 0, 2, 4 of 7


# --------------------------------------------------------------------------------------------- end to end
def test_callback_matches_an_independent_computation_and_skips_a_corrupt_video(tmp_path):
    sequences = imagenet_p_tree(tmp_path / "p")
    broken = tmp_path / "p" / "brightness" / WNIDS[2] / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42 this is no video" + bytes(range(256)))
    model = PoolModel()
    section = run_callback(tmp_path / "p", tmp_path / "run", model)

    for perturbation, paths in sequences.items():
        noise = perturbation != "brightness"
        fps, t5ds = [], []
        for path in paths:
            with torch.no_grad():
                logits = model(decode(path))
            fps.append(brute_force_flips(logits.argmax(1).tolist(), noise))
            t5ds.append(brute_force_t5d(logits.tolist(), noise))
        values = section["perturbations"][perturbation]
        assert values["num_sequences"] == len(paths)
        assert values["fp"] == pytest.approx(np.mean(fps), abs=1e-12)
        assert values["t5d"] == pytest.approx(np.mean(t5ds), abs=1e-12)
        assert values["fr"] == pytest.approx(values["fp"] / alexnet_flip_probabilities()[perturbation], abs=1e-12)
        assert values["compared"] == ("every frame with the first" if noise else "consecutive frames")
        assert len(set(fps)) > 1 or len(set(t5ds)) > 1  # the sequences differ: the check discriminates

    brightness = section["perturbations"]["brightness"]
    assert len(brightness["corrupt_files"]) == 1 and str(broken) in brightness["corrupt_files"][0]
    assert section["corrupt_files"] == brightness["corrupt_files"]
    assert brightness["num_frames"] == {"min": 4, "max": 6}
    assert section["unusual_length"] == [
        f"{sequences['gaussian_noise'][2]} (12 frames, most have 6)",
        f"{sequences['brightness'][3]} (4 frames, most have 6)",
    ]
    assert section["perturbations"]["gaussian_noise"]["num_frames"] == {"min": 6, "max": 12}
    assert section["num_sequences"] == 9
    assert "mfr" not in section and section["mfr_partial"]["perturbations"] == ["gaussian_noise", "brightness"]
    assert section["validation"]["perturbations"] == ["speckle_noise"]
    assert section["validation"]["mfr"] == section["perturbations"]["speckle_noise"]["fr"]
    assert section["preprocessing"] == "none (frames fed as decoded)"
    assert {shape[1:] for shape in model.shapes} == {(3, SIZE, SIZE)}


def test_frames_are_resized_only_for_another_model_resolution_and_wandb_gets_the_plot(tmp_path):
    imagenet_p_tree(tmp_path / "p")
    model, wandb = PoolModel(image_size=24), FakeWandb()
    section = run_callback(
        tmp_path / "p", tmp_path / "run", model, loggers=[wandb], plot=True, max_videos_per_perturbation=1
    )
    assert {shape[1:] for shape in model.shapes} == {(3, 24, 24)}
    assert section["preprocessing"] == "resize 32 x 32 to 24 x 24 (bicubic)"
    assert section["conditions"]["image_size"] == 24 and section["conditions"]["frame_sizes"] == [[32, 32]]
    assert section["conditions"]["subsampled"] and section["num_sequences"] == 3
    assert wandb.images == {"imagenet_p/plot": [section["plot"]]} and Path(section["plot"]).is_file()
    assert wandb.metrics["imagenet_p/brightness/fp"] == section["perturbations"]["brightness"]["fp"]
    assert wandb.metrics["imagenet_p/validation/mfr"] == section["validation"]["mfr"]


def test_ddp_splits_sequences_over_ranks_and_gathers_each_once(tmp_path, monkeypatch):
    """Two ranks as two threads, torch.distributed's gather replaced by an exchange between them (a real
    two-process run costs ~20 s of imports on 2 cores; the gather is the one predict_split uses under real DDP)."""
    import threading

    import torch.distributed as dist

    sequences = imagenet_p_tree(tmp_path / "p")  # 9 sequences: an odd split
    barrier, parts, local, errors = threading.Barrier(2, timeout=60), {}, threading.local(), []

    def all_gather_object(output: list, obj) -> None:
        parts[local.rank] = obj
        barrier.wait()
        output[:] = [parts[0], parts[1]]

    def all_reduce(tensor, op=None) -> None:  # the agreement whether to stop at a loop's end (a maximum)
        parts["reduce", local.rank] = tensor.clone()
        barrier.wait()
        tensor.copy_(torch.maximum(parts["reduce", 0], parts["reduce", 1]))
        barrier.wait()  # both have read before either reduces again

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: local.rank)  # the DataLoader asks
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    models = [PoolModel(), PoolModel()]

    def rank(r: int) -> None:
        local.rank = r
        try:
            callback = ImageNetP(
                root=str(tmp_path / "p"),
                batch_size=2,
                num_workers=0,
                plot=False,
                perturbations=["gaussian_noise", "brightness", "speckle_noise"],
            )
            trainer = fake_trainer(tmp_path / "ddp", world_size=2, rank=r, barrier=barrier.wait)
            callback.on_test_start(trainer, models[r])
            callback.on_test_end(trainer, models[r])
        except Exception as e:  # re-raised in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    ddp = json.loads((tmp_path / "ddp" / "results.json").read_text())["imagenet_p"]
    monkeypatch.undo()
    single = run_callback(tmp_path / "p", tmp_path / "single", PoolModel())
    # each rank decoded its own share, without padding: together every frame exactly once
    frames = [sum(shape[0] for shape in model.shapes) for model in models]
    total = sum(len(decode(path)) for paths in sequences.values() for path in paths)
    assert min(frames) > 0 and sum(frames) == total
    assert ddp["num_sequences"] == single["num_sequences"] == 9
    for perturbation, values in single["perturbations"].items():
        for key in ("num_sequences", "num_frames", "fp", "fr", "t5d"):
            assert ddp["perturbations"][perturbation][key] == pytest.approx(values[key], abs=1e-12), key


# ------------------------------------------------------------------------------------------ through the CLI
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny untrained 1000-class classifier at 32 px."""
    from lightning import Trainer

    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(arch="test_resnet", num_classes=1000, image_size=SIZE)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    path = tmp_path_factory.mktemp("imagenet-p-ckpt") / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path


def cli_config(tmp_path: Path, root: Path) -> Path:
    """configs/eval/imagenet_p.yaml pointed at the tiny replicas, on the CPU, for a run in the test's process: without
    loader workers (they would be forks of the test process) and progress bars. The SIGTERM test below runs the
    config's workers and bars in a process of its own."""
    make_image_tree(tmp_path / "imagenet" / "val", {WNIDS[0]: 2, WNIDS[1]: 1})
    config = yaml.safe_load((REPO / "configs" / "eval" / "imagenet_p.yaml").read_text())
    config["trainer"].update(
        accelerator="cpu", devices=1, enable_progress_bar=False, default_root_dir=str(tmp_path / "runs")
    )
    config["trainer"]["logger"]["init_args"].update(save_dir=str(tmp_path / "runs"), name="p")
    [callback] = config["trainer"]["callbacks"]
    assert callback["class_path"] == "robust_lightning.evaluation.imagenet_p.ImageNetP"
    callback["init_args"].update(
        root=str(root), perturbations=["gaussian_noise", "brightness"], batch_size=3, num_workers=0
    )
    config["model"] = {"arch": "test_resnet"}
    config["data"]["source"]["init_args"]["root"] = str(tmp_path / "imagenet")
    config["data"].update(image_size=SIZE, eval_batch_size=4, num_workers=0)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_cli_run_with_the_eval_config_writes_the_imagenet_p_section(tmp_path, checkpoint):
    from robust_lightning.cli import main

    imagenet_p_tree(tmp_path / "imagenet-p")
    assert (
        main(["test", "--config", str(cli_config(tmp_path, tmp_path / "imagenet-p")), "--ckpt_path", str(checkpoint)])
        == 0
    )
    results_file = next((tmp_path / "runs" / "p").glob("version_*/results.json"))
    results = json.loads(results_file.read_text())
    section = results["imagenet_p"]
    assert "test" in results  # the model's own test set ran first
    assert list(section["perturbations"]) == ["gaussian_noise", "brightness"]
    for values in section["perturbations"].values():
        assert 0 <= values["fp"] <= 1 and values["t5d"] >= 0 and values["corrupt_files"] == []
    assert section["num_sequences"] == 7 and section["conditions"]["image_size"] == SIZE
    plot = results_file.parent / "imagenet_p.png"
    assert section["plot"] == str(plot.resolve()) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = (results_file.parent / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {
        "imagenet_p/mfr_partial",
        "imagenet_p/mt5d_partial",
        "imagenet_p/brightness/fr",
        "imagenet_p/gaussian_noise/t5d",
    } <= set(logged)


def test_sigterm_to_every_process_stops_imagenet_p_and_the_same_command_then_finishes(tmp_path, checkpoint):
    """With the config's loader workers and progress bars, which the in-process run above switches off: SIGTERM to
    every process of the command in ImageNet-P's first forward pass, its decoding workers included as SLURM
    signals a job step, stops the command with status 143 and no traceback, and no results.json is written.
    The same command again, on two ranks, goes on from the sequences the stopped run predicted and writes the
    section with the numbers of the run without workers."""
    from robust_lightning.cli import main

    root = tmp_path / "imagenet-p"
    imagenet_p_tree(root)
    alone = cli_config(tmp_path / "alone", root)
    assert main(["test", "--config", str(alone), "--ckpt_path", str(checkpoint)]) == 0
    [alone_results] = (tmp_path / "alone" / "runs" / "p").glob("version_*/results.json")
    expected = json.loads(alone_results.read_text())["imagenet_p"]["perturbations"]

    config = yaml.safe_load(alone.read_text())
    shipped = yaml.safe_load((REPO / "configs" / "eval" / "imagenet_p.yaml").read_text())
    config["trainer"]["enable_progress_bar"] = True
    config["trainer"]["default_root_dir"] = str(tmp_path / "stopped")
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "stopped")
    config["data"]["num_workers"] = shipped["data"]["num_workers"]
    [callback] = config["trainer"]["callbacks"]
    callback["class_path"] = "stop_points.ImageNetPStoppedAt"
    callback["init_args"].update(
        marks=str(tmp_path / "marks"), num_workers=shipped["trainer"]["callbacks"][0]["init_args"]["num_workers"]
    )
    assert callback["init_args"]["num_workers"] > 1 and config["data"]["num_workers"] > 1
    path = tmp_path / "stopped.yaml"
    path.write_text(yaml.safe_dump(config))
    command = ["test", "--config", str(path), "--ckpt_path", str(checkpoint)]

    stopped = run_command(command, cwd=tmp_path, timeout=180)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 143, output[-3000:]
    assert "Traceback" not in output and "killed by signal" not in output, output[-3000:]
    assert (tmp_path / "marks" / "imagenet_p").exists()
    assert not list((tmp_path / "stopped" / "p").glob("version_*/results.json"))

    again = run_command([*command, "--trainer.devices", "2", "--trainer.strategy", "ddp"], cwd=tmp_path, timeout=180)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "imagenet_p: resuming, " in again.stdout + again.stderr  # the stopped run's first batch is kept
    [results] = (tmp_path / "stopped" / "p").glob("version_*/results.json")
    section = json.loads(results.read_text())["imagenet_p"]
    for perturbation, values in expected.items():
        for key in ("num_sequences", "num_frames", "fp", "t5d"):
            assert section["perturbations"][perturbation][key] == pytest.approx(values[key], abs=1e-12), key


def test_cli_fails_at_test_start_on_a_bad_root(tmp_path, checkpoint, capsys):
    from robust_lightning.cli import main

    config = cli_config(tmp_path, tmp_path / "missing")
    assert main(["test", "--config", str(config), "--ckpt_path", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "does not exist; expected <root>/<perturbation>/<wnid>/<sequence>.mp4" in err
    assert not list((tmp_path / "runs").glob("**/results.json"))  # failed before any work
