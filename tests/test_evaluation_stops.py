"""An evaluation stopped by SIGTERM stops at its next batch, keeps the outcomes of every batch it finished and
publishes nothing; the same call or command again goes on from them to the numbers of the evaluation left alone
(issue 44): ``robust_lightning.evaluate`` from a script, and the ``validate`` command. Each in a process of its own,
under a hard time limit (the last test excepted: it reads a handler of its own process)."""

import json
import signal
import textwrap
from pathlib import Path

import torch
import yaml
from torch import nn

import robust_lightning
from helpers import eval_config, run_command, tiny_config, untrained_checkpoint
from robust_lightning.evaluation.results import RunResults

SCRIPT = textwrap.dedent(
    """
    # robust_lightning.evaluate on 12 points in batches of 4; with a marker file's path, the model sends this process
    # SIGTERM once: in its first pass over the second batch, or, with SANITY_POINTS set, in its first pass inside
    # an APGD run of the sanity checks (on the first batch, before its attacks)
    import json, os, signal, sys
    from pathlib import Path
    import torch
    from torch import nn
    import robust_lightning

    out_dir, marker = sys.argv[1], (Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(12, 3, 16, 16, generator=generator)
    y = torch.randint(0, 10, (12,), generator=generator)
    calls = [0]  # the attack runs copies of the model: the count is the process's
    sanity_points = int(os.environ.get("SANITY_POINTS", "0"))

    def signal_here(inputs):
        if not sanity_points:
            return any(torch.equal(image, x[4]) for image in x_in(inputs))
        callers, frame = set(), sys._getframe()
        while frame is not None:
            callers.add(frame.f_code.co_name)
            frame = frame.f_back
        return {"_apgd_robust", "apgd"} <= callers

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                                      nn.Flatten(), nn.Linear(128, 10))

        def forward(self, inputs):
            calls[0] += 1
            if marker is not None and not marker.exists() and signal_here(inputs):
                marker.write_text(str(calls[0]))
                os.kill(os.getpid(), signal.SIGTERM)
            return self.body(inputs)

    def x_in(inputs):
        return inputs.detach().contiguous()

    net = Net()
    try:
        results = robust_lightning.evaluate(
            net, (x, y), ["autoattack"], threat_models=[{"norm": "Linf", "eps": 8 / 255}], version="apgd-ce",
            batch_size=4, out_dir=out_dir, options={"autoattack": {"n_iter": 10, "sanity_points": sanity_points}},
        )
    finally:
        print("\\nforward passes", calls[0], flush=True)  # after the bar; flushed, as a stopped script ends by SIGTERM
    print("RESULT " + json.dumps(results["autoattack"]["threat_models"]))
    """
)


def evaluate(tmp_path: Path, out_dir: Path, *marker: Path, sanity_points: int = 0):
    script = tmp_path / "evaluate.py"
    script.write_text(SCRIPT)
    env = {"SANITY_POINTS": str(sanity_points)}
    return run_command([str(out_dir), *map(str, marker)], cwd=tmp_path, timeout=240, env=env, script=script)


def forward_passes(done) -> int:
    return int(next(line for line in done.stdout.splitlines() if line.startswith("forward passes ")).split()[-1])


def result_of(done) -> dict:
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    sections = json.loads(line.removeprefix("RESULT "))
    for section in sections.values():
        section.pop("seconds_this_session")  # what each session did (its times, its fp32 checks) is its own
        section.pop("claims_refuted_in_fp32_this_session")
    return sections


def test_evaluate_stops_at_the_next_batch_on_sigterm_and_the_same_call_goes_on(tmp_path):
    alone = evaluate(tmp_path, tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr[-3000:]

    out_dir, marker = tmp_path / "stopped", tmp_path / "signalled"
    stopped = evaluate(tmp_path, out_dir, marker)
    assert marker.exists()
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # a script ends as a process ended by SIGTERM
    assert "Traceback" not in stopped.stderr and "RESULT" not in stopped.stdout  # nothing partial returned
    assert not (out_dir / "results.json").exists()  # nor written
    # the signal came in the second batch's first pass (the test step's), before its attack started: the first
    # batch's outcomes are kept, and neither the second's attack nor the third batch ran
    [threat] = list((out_dir / "autoattack").iterdir())
    assert len((threat / "rank0.jsonl").read_text().splitlines()) == 1
    assert f"evaluate stopped by SIGTERM; the same call with out_dir={out_dir} goes on" in stopped.stderr

    resumed = evaluate(tmp_path, out_dir, marker)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming, 4 images already done" in resumed.stdout + resumed.stderr
    assert result_of(resumed) == result_of(alone)


def test_a_stop_inside_the_sanity_checks_ends_them_at_the_next_apgd_run_and_the_same_call_goes_on(tmp_path):
    """The sanity checks of the first batch (about a hundred passes of APGD over sanity_points images, on a large
    model minutes) ask for a stop before each APGD run: SIGTERM in the first APGD run ends the call after that run,
    not after the checks; nothing of the batch is kept, and the same call again runs the checks from their start
    and ends with the numbers and checks of the evaluation left alone."""
    alone = evaluate(tmp_path, tmp_path / "alone", sanity_points=8)
    assert alone.returncode == 0, alone.stderr[-3000:]
    passes_alone = forward_passes(alone)

    out_dir, marker = tmp_path / "stopped", tmp_path / "signalled"
    stopped = evaluate(tmp_path, out_dir, marker, sanity_points=8)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "RESULT" not in stopped.stdout
    # the rest of one 10-iteration APGD run after the signal, then the stop: not the rest of the checks and attacks
    signalled_at = int(marker.read_text())
    assert forward_passes(stopped) - signalled_at <= 12 and passes_alone - signalled_at > 100
    [threat] = list((out_dir / "autoattack").iterdir())
    assert not (threat / "rank0.jsonl").exists() and not (threat / "checks.json").exists()

    resumed = evaluate(tmp_path, out_dir, marker, sanity_points=8)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert result_of(resumed) == result_of(alone)


def test_validate_stops_at_the_next_batch_on_sigterm_and_publishes_nothing(tmp_path):
    checkpoint = untrained_checkpoint(tmp_path, "test_resnet")
    callbacks = [
        {
            "class_path": "stop_points.StopAt",
            "init_args": {"points": ["validation:0:1"], "marks": str(tmp_path / "marks")},
        }
    ]
    config = tiny_config(
        tmp_path,
        **{
            "trainer.callbacks": callbacks,
            "trainer.limit_val_batches": None,
            "data.eval_batch_size": 4,
            "model.arch": "test_resnet",
            "model.select_attack_steps": 1,
            "data.source.init_args.num_classes": 10,
            "data.source.init_args.val_per_class": 1,
        },
    )
    command = ["validate", "--config", str(config), "--ckpt_path", str(checkpoint)]
    stopped = run_command(command, cwd=tmp_path, timeout=240)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "validate interrupted by SIGTERM (exit status 143); the same command resumes it" in stopped.stderr
    assert "Traceback" not in stopped.stdout + stopped.stderr
    results = tmp_path / "runs" / "tiny" / "version_0" / "results.json"
    assert "validate" not in (json.loads(results.read_text()) if results.exists() else {})

    # the same command again validates every image (the stop point fired once)
    again = run_command(command, cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    [written] = (tmp_path / "runs" / "tiny").glob("version_*/results.json")
    assert json.loads(written.read_text())["validate"]["metrics"]["val/num_images"] == 10


def test_a_two_rank_test_stopped_by_sigterm_keeps_each_ranks_batches_and_goes_on(tmp_path, autoattack_checkpoint):
    """``test`` with AutoAttack on 2 gloo ranks (the progress display and a loader worker per rank, as a user runs
    it), SIGTERM to every process of the job after rank zero's first batch: every rank stops at its next batch
    boundary, exit 143 without a traceback, nothing published; the same command again resumes the outcomes of
    each rank's finished batches and ends with the results of the test left alone."""
    ckpt, synthetic_root = autoattack_checkpoint
    results = {}
    for name, marks in (("alone", None), ("stopped", tmp_path / "marks")):
        folder = tmp_path / name
        folder.mkdir()
        config = yaml.safe_load(eval_config(folder, synthetic_root, devices=2).read_text())
        callback = config["trainer"]["callbacks"][0]
        callback["class_path"] = "stop_points.AutoAttackStoppedAt"
        # the model's checks are another test's: here only the stop and the resume
        callback["init_args"] |= {
            "after": 1,
            "checks": False,
            "sanity_points": 0,
            **({"marks": str(marks)} if marks else {}),
        }
        config["data"] |= {"eval_batch_size": 4, "num_workers": 1}  # 10 images a rank: batches of 4, 4 and 2
        (folder / "test.yaml").write_text(yaml.safe_dump(config))
        command = ["test", "--config", str(folder / "test.yaml"), "--ckpt_path", str(ckpt)]
        done = run_command(command, cwd=folder, timeout=240)
        if marks is not None:
            assert done.returncode == 143, done.stderr[-3000:]
            assert "Traceback" not in done.stdout + done.stderr
            assert "test interrupted by SIGTERM (exit status 143); the same command resumes it" in done.stderr
            assert not list(folder.glob("runs/aa/version_*/results.json"))
            outcomes = sorted((folder / "outcomes").glob("*/rank*.jsonl"))
            assert outcomes and all(len(p.read_text().splitlines()) < 3 for p in outcomes)  # no rank finished
            done = run_command(command, cwd=folder, timeout=240)
            assert "already done" in done.stdout + done.stderr
        assert done.returncode == 0, done.stderr[-3000:]
        [written] = folder.glob("runs/aa/version_*/results.json")
        section = json.loads(written.read_text())["autoattack"]["threat_models"]
        for threat in section.values():
            threat.pop("seconds_this_session")
            threat.pop("claims_refuted_in_fp32_this_session", None)
        results[name] = section
    assert results["stopped"] == results["alone"]
    assert next(iter(results["alone"].values()))["num_points"] == 20


def test_a_sigterm_after_the_evaluations_last_batch_goes_to_the_callers_handler(tmp_path, monkeypatch):
    """SIGTERM while ``robust_lightning.evaluate`` writes its results, after the last batch boundary: the evaluation
    notes it and finishes, and the caller's own handler gets it once evaluate has given the handlers back, as if no
    evaluation had been running. Before, the noted signal was dropped. In this process, where the caller's handler
    is; the model and the attack are tiny."""
    on_test_end, handlers = RunResults.on_test_end, []

    def signalled(self, trainer, pl_module):
        handlers.append(signal.getsignal(signal.SIGTERM))
        signal.raise_signal(signal.SIGTERM)
        return on_test_end(self, trainer, pl_module)

    monkeypatch.setattr(RunResults, "on_test_end", signalled)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    x, y = torch.rand(4, 3, 8, 8), torch.arange(4)
    received: list[int] = []

    def callers_handler(signum, frame):
        received.append(signum)

    before = signal.signal(signal.SIGTERM, callers_handler)
    try:
        results = robust_lightning.evaluate(
            net, (x, y), threat_models=[{"norm": "Linf", "eps": 8 / 255}], version="apgd-ce", adaptive="none",
            n_iter=2, batch_size=4, out_dir=tmp_path, accelerator="cpu", image_size=8,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, before)
    assert results["autoattack"]["threat_models"]["Linf-8_255"]["clean_accuracy"] is not None
    assert len(handlers) == 1 and callable(handlers[0]) and handlers[0] is not callers_handler  # the evaluation's
    assert received == [signal.SIGTERM]
