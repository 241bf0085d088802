"""On a real single-node SLURM cluster (munged + slurmctld + slurmd started by the fixture, see slurm_cluster.py):
a sweep array job and its merged report, a 2-task srun DDP fit through Lightning's SLURM environment, and a
SIGUSR1 requeue that resumes from the checkpoint. CPU only; deselect with ``pytest -m "not slurm"``."""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO, WNIDS, conversion_manifest, make_image_tree, synthetic_source, write_image
from robust_lightning.cli import main
from slurm_cluster import FINISHED, ClusterUnavailable, SlurmCluster

pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = time.time()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except ClusterUnavailable as e:
        cluster.stop()
        pytest.skip(f"no SLURM cluster in this environment: {e}")
    print(f"SLURM cluster up in {time.time() - started:.1f} s", file=sys.stderr)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm_env(cluster, monkeypatch):
    """SLURM clients of this process and the jobs (sbatch passes the environment on) see the test cluster;
    one thread per task keeps concurrent tasks from fighting over the 2 cores."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(REPO)  # sweep files name configs relative to the checkout
    return cluster


def synthetic(root: Path, per_shard: int = 10) -> dict:
    return {
        "num_classes": 10,
        "train_per_class": 4,
        "val_per_class": 2,
        "image_size": 32,
        "samples_per_shard": per_shard,
        "root": str(root),
    }


def fit_config(tmp_path: Path, name: str, num_workers: int = 0, **trainer) -> Path:
    config = {
        "seed_everything": 0,
        # the progress display on: printed lines in the job's log, as on a real cluster
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": 1,
            "num_sanity_val_steps": 0,
            "enable_model_summary": False,
            **trainer,
        },
        "model": {"arch": "test_resnet", "warmup_epochs": 0.5},
        # 10-image shards: 4 training and 2 validation shards, enough for two ranks
        "data": {
            "source": {"class_path": "SyntheticSource", "init_args": synthetic(tmp_path / "synthetic", per_shard=10)},
            "image_size": 32,
            "batch_size": 8,
            "num_workers": num_workers,
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def submit_training(
    cluster: SlurmCluster, config: Path, run_dir: Path | None, tasks: int, cwd: Path = REPO, env: dict | None = None
) -> str:
    """slurm/train_multinode.sbatch on this 1-node CPU cluster: the template as shipped, with the node, task and
    GPU counts overridden on the sbatch command line as a user would. run_dir None: the template's own RUN_DIR
    and log file, relative to ``cwd``."""
    where = [] if run_dir is None else [f"--output={run_dir}.out"]
    env = {"CONFIG": str(config), "PYTHON": sys.executable, **(env or {})}
    if run_dir is not None:
        env["RUN_DIR"] = str(run_dir)
    out = cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=1",
        f"--ntasks-per-node={tasks}",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--mem=0",
        "--time=10",
        *where,
        str(REPO / "slurm" / "train_multinode.sbatch"),
        env=env,
        cwd=cwd,
    )
    return out.stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny 10-class model on the quickstart's synthetic data source (the quickstart's ResNet-18 takes minutes)."""
    tmp_path = tmp_path_factory.mktemp("tiny")
    config = fit_config(tmp_path, "fit", limit_train_batches=3, default_root_dir=str(tmp_path / "run"), logger=False)
    assert main(["fit", "--config", str(config), "--checkpoint.dirpath", str(tmp_path / "ckpt")]) == 0
    return tmp_path / "ckpt" / "last.ckpt", tmp_path / "synthetic"


def test_sweep_array_job_then_report(slurm_env, tiny_checkpoint, tmp_path, capsys):
    cluster = slurm_env
    checkpoint, synthetic_root = tiny_checkpoint
    # configs/sweeps/quickstart.yaml as shipped (2 resolutions x clean / APGD-CE), on the tiny model and data
    spec = yaml.safe_load((REPO / "configs" / "sweeps" / "quickstart.yaml").read_text())
    spec["grid"]["ckpt_path"] = {"tiny": str(checkpoint)}
    spec["grid"]["benchmark"]["apgd_ce"]["args"]["trainer.callbacks.init_args.n_iter"] = 3
    spec["args"].update(
        {
            "data.eval_limit": 10,
            "data.eval_batch_size": 10,
            "data.num_workers": 0,
            "data.source": synthetic_source(**synthetic(synthetic_root)),
            "trainer.accelerator": "cpu",
            "trainer.enable_model_summary": False,
        }
    )
    spec["output_dir"] = str(tmp_path / "sweep")
    spec["slurm"] = {"time": "00:10:00", "cpus-per-task": 1}
    sweep_file = tmp_path / "quickstart.yaml"
    sweep_file.write_text(yaml.safe_dump(spec))

    assert main(["sweep", "--config", str(sweep_file)]) == 0
    out = capsys.readouterr().out
    assert "4 cells, 0 done, 0 in the queue, 4 to run: submitted array job" in out
    output = tmp_path / "sweep"
    submissions = json.loads((output / "submissions.json").read_text())
    assert len(submissions) == 1 and len(submissions[0]["cells"]) == 4
    records = cluster.wait(submissions[0]["job_id"], timeout=300)
    assert len(records) == 4
    logs = {r["JobId"]: (output / "logs" / f"{submissions[0]['job_id']}_{r['ArrayTaskId']}.out") for r in records}
    for record in records:
        assert record["JobState"] == "COMPLETED", logs[record["JobId"]].read_text()[-3000:]

    # every cell ran with its own values, in its own directory
    description = json.loads((output / "sweep.json").read_text())
    for cell in description["cells"]:
        results = json.loads((output / cell["dir"] / "results.json").read_text())
        assert results["sweep"]["status"] == "done" and results["sweep"]["cell"] == cell["id"]
        assert results["test"]["conditions"]["data"]["image_size"] == int(cell["labels"]["data.image_size"])
        assert ("autoattack" in results) == (cell["labels"]["benchmark"] == "apgd_ce")

    # a re-run submits nothing
    assert main(["sweep", "--config", str(sweep_file)]) == 0
    assert "4 done, 0 in the queue, 0 to run: nothing to submit" in capsys.readouterr().out
    assert len(json.loads((output / "submissions.json").read_text())) == 1

    assert main(["report", str(output)]) == 0
    report = json.loads((output / "report.json").read_text())
    assert report["done"] == report["cells"] == 4 and report["missing_or_failed"] == []
    cells = {(r["data.image_size"], r["benchmark"]): r for r in report["rows"]}
    assert set(cells) == {("32", "clean"), ("32", "apgd_ce"), ("48", "clean"), ("48", "apgd_ce")}
    for (_size, benchmark), row in cells.items():
        assert row["status"] == "done" and row["test/num_images"] == 10
        robust = row.get("autoattack.Linf-4_255.robust_accuracy")
        assert (robust is not None) == (benchmark == "apgd_ce")
        if robust is not None:
            assert 0 <= robust <= row["autoattack.Linf-4_255.clean_accuracy"] <= 1
    assert (output / "report.md").read_text().count("| tiny |") == 4
    assert len((output / "report.csv").read_text().splitlines()) == 5
    before = {name: (output / name).read_bytes() for name in ("report.md", "report.csv", "report.json")}
    assert main(["report", str(output)]) == 0
    assert {name: (output / name).read_bytes() for name in before} == before

    # a cell that failed is retried by the next sweep and listed, with its SLURM log, by the report
    failed = description["cells"][1]
    results_path = output / failed["dir"] / "results.json"
    results = json.loads(results_path.read_text())
    results["sweep"].update(status="failed", error="simulated failure")
    results_path.write_text(json.dumps(results))
    capsys.readouterr()
    assert main(["sweep", "--config", str(sweep_file), "--dry_run"]) == 0
    dry = capsys.readouterr().out
    assert "#SBATCH --array=0-0" in dry and f"[0] {failed['id']}" in dry and "3 done" in dry
    assert main(["report", str(output)]) == 0
    report = json.loads((output / "report.json").read_text())
    assert report["done"] == 3 and [p["cell"] for p in report["missing_or_failed"]] == [failed["id"]]
    problem = report["missing_or_failed"][0]
    assert problem["reason"] == "simulated failure" and "test finished" in problem["log_tail"]


def test_srun_ddp_fit_with_two_tasks(slurm_env, tmp_path):
    cluster = slurm_env
    config = fit_config(tmp_path, "ddp", strategy="ddp")
    # the template's defaults: RUN_DIR and the log file named after the job, W&B offline on the compute node
    job = submit_training(
        cluster, config, None, tasks=2, cwd=tmp_path, env={"WANDB_PROJECT": "slurm-test", "WANDB_MODE": "offline"}
    )
    record = cluster.wait(job, timeout=240)[0]
    name = record["JobName"]  # the template's #SBATCH --job-name
    log = (tmp_path / f"slurm-{name}-{job}.out").read_text()
    assert record["JobState"] == "COMPLETED", log[-3000:]
    run_dir = tmp_path / "runs" / "slurm" / f"{name}-{job}"
    assert (run_dir / "metrics.csv").is_file() and (run_dir / "config.yaml").is_file()
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    # two processes started by srun, ranks from SLURM (not spawned by Lightning), over gloo
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log and "distributed_backend=gloo" in log
    assert log.count("SLURM's requeue signal (SIGUSR1) and SIGTERM stop this fit at its next batch boundary") == 1
    assert "epoch 0 done in" in log and "\r" not in log  # progress as printed lines (rank zero's), no bar
    fit = json.loads((run_dir / "results.json").read_text())["fit"]
    assert fit["conditions"]["world_size"] == 2
    assert fit["metrics"]["val/num_images"] == 20  # 10 classes x 2 validation images, each counted once
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def test_sigusr1_requeues_and_resumes_from_the_checkpoint(slurm_env, tmp_path):
    cluster = slurm_env
    record = tmp_path / "batches.jsonl"
    # the job holds at step 7, in the second epoch, until the signal has reached it
    pace = {
        "class_path": "slurm_cluster.Pace",
        "init_args": {"record": str(record), "seconds": 0, "hold_at": {"step": 7}},
    }
    # 3 epochs x 5 batches; a forked DataLoader worker, which SLURM signals too
    config = fit_config(tmp_path, "slow", num_workers=1, max_epochs=3, callbacks=[pace])
    run_dir = tmp_path / "run"
    job = submit_training(cluster, config, run_dir, tasks=1)

    def batches() -> list[dict]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []

    deadline = time.time() + 180
    while len(batches()) < 7:
        assert time.time() < deadline and cluster.job(job).get("JobState") in ("PENDING", "RUNNING"), (
            Path(f"{run_dir}.out").read_text()[-3000:] if Path(f"{run_dir}.out").is_file() else cluster.job(job)
        )
        time.sleep(0.2)
    # what SLURM sends 90 s before the time limit with #SBATCH --signal=SIGUSR1@90
    cluster.run("scancel", "--signal=USR1", job)
    while (now := cluster.job(job)).get("Restarts") != "1" or now.get("JobState") not in ("PENDING", "RUNNING"):
        ended = now.get("Restarts") == "0" and now.get("JobState") in FINISHED  # Pace's hold failed it, say
        assert time.time() < deadline and not ended, f"{now}\n{Path(f'{run_dir}.out').read_text()[-3000:]}"
        time.sleep(0.5)
    # SLURM holds a requeued batch job for about two minutes (BeginTime); let it start now
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    final = cluster.wait(job, timeout=180)[0]
    log = Path(f"{run_dir}.out").read_text()  # both attempts (open-mode=append)
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", log[-3000:]
    # the training process alone handled the signal (not the DataLoader worker) and requeued the job once
    assert log.count("Handling auto-requeue signal") == 1 and "attempt 2:" in log
    assert f"Restored all states from the checkpoint at {run_dir / 'hpc_ckpt_1.ckpt'}" in log
    saved = torch.load(run_dir / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=True)["global_step"]
    second = [b["step"] for b in batches() if b["attempt"] == 1]
    # resumed after the step it was signalled in, each later step trained once
    assert saved == 7 and second == list(range(8, 16))
    fit = json.loads((run_dir / "results.json").read_text())["fit"]
    assert fit["steps"] == 15 and fit["epochs"] == 3


def test_sigusr1_requeues_a_shards_conversion_and_the_requeued_job_finishes_it(slurm_env, tmp_path):
    """`robust-lightning shards` in a batch job submitted with --requeue, stopped by SLURM's requeue signal in its
    last shard: it requeues the job with the real scontrol, prints its one line although SLURM then sends SIGTERM to
    the job's processes, and exits 143. The requeued job runs the same command, which keeps the shard the first
    attempt finished and ends with the manifest of a conversion left alone."""
    cluster = slurm_env
    src = make_image_tree(tmp_path / "src", {wnid: 2 for wnid in WNIDS[:2]})  # 4 images, 2 shards of 2
    # The last image is a named pipe at first: reading it waits until the test writes it, so the first attempt is
    # still converting the last shard when the signal comes, however slowly it arrives.
    held = src / WNIDS[1] / f"{WNIDS[1]}_1.JPEG"
    held.unlink()
    os.mkfifo(held)
    out, log = tmp_path / "out", tmp_path / "shards.out"
    # --workers 1: the command's own process reads the pipe, where the signal interrupts the wait; a pool's worker
    # would wait for the pipe as the pool's shutdown waits for it (tests/test_shards.py stops a pooled conversion)
    options = ["--samples_per_shard", "2", "--shuffle", "false", "--workers", "1"]
    script = tmp_path / "shards.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
        f'srun "{sys.executable}" -m robust_lightning shards {src} {out} {" ".join(options)}\n'
    )
    submitted = cluster.run("sbatch", "--parsable", "--time=10", f"--output={log}", str(script), cwd=tmp_path)
    job = submitted.stdout.strip().split(";")[0]
    # the first shard (the prefix is SRC's name), and its stats file, which marks it finished
    first_shard = [out / "src-000000.tar", out / "src-000000.json"]
    try:
        deadline = time.time() + 180
        while not first_shard[1].is_file():
            state = cluster.job(job).get("JobState")
            assert time.time() < deadline and state in ("PENDING", "RUNNING"), (
                log.read_text() if log.is_file() else state
            )
            time.sleep(0.2)
        first_written = [path.stat().st_mtime_ns for path in first_shard]
        # what SLURM sends 90 s before the time limit with #SBATCH --signal=SIGUSR1@90
        cluster.run("scancel", "--signal=USR1", job)
        while (now := cluster.job(job)).get("Restarts") != "1" or now.get("JobState") != "PENDING":
            ended = now.get("Restarts") == "0" and now.get("JobState") in FINISHED
            assert time.time() < deadline and not ended, f"{now}\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        held.unlink()
        write_image(held, seed=3)  # the image make_image_tree wrote there
        # SLURM holds a requeued batch job for about two minutes (BeginTime); let it start now
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        final = cluster.wait(job, timeout=180)[0]
    finally:
        cluster.run("scancel", "--full", job, check=False)
    output = log.read_text()  # both attempts (open-mode=append)
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", output[-3000:]
    ours = [line for line in output.splitlines() if line.startswith("robust-lightning")]
    stopped = "shards stopped for SLURM's requeue; the requeued job runs the same command again (exit status 143)"
    assert ours == [f"robust-lightning: {stopped}"], output[-3000:]
    assert "Traceback" not in output and output.count(f"Requeued SLURM job: {job}") == 1, output[-3000:]
    # SLURM's SIGTERM to the requeued job's processes did not end the command's process: it exited 143 itself
    assert "task 0: Exited with exit code 143" in output, output[-3000:]
    assert [path.stat().st_mtime_ns for path in first_shard] == first_written  # the requeued job kept it

    assert main(["shards", str(src), str(tmp_path / "alone"), *options]) == 0
    assert conversion_manifest(out) == conversion_manifest(tmp_path / "alone")


def test_eval_array_template_gives_each_checkpoint_its_directory(slurm_env, tiny_checkpoint, tmp_path):
    cluster = slurm_env
    checkpoint, synthetic_root = tiny_checkpoint
    ckpts = tmp_path / "ckpts.txt"
    ckpts.write_text(f"# one checkpoint per line\n\n{checkpoint}\n")
    job = (
        cluster.run(
            "sbatch",
            "--parsable",
            "--array=0-0",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            "--mem=0",
            "--time=10",
            f"--output={tmp_path}/eval_%A_%a.out",
            str(REPO / "slurm" / "eval_array.sbatch"),
            "--trainer.accelerator=cpu",
            "--data.eval_limit=10",
            "--data.num_workers=0",
            f"--data.source={json.dumps(synthetic_source(**synthetic(synthetic_root)))}",
            "--trainer.callbacks.init_args.version=apgd-ce",
            "--trainer.callbacks.init_args.n_iter=3",
            '--trainer.callbacks.init_args.threat_models=[{"norm": "Linf", "eps": 0.01568627450980392}]',
            # OUT_ROOT unset: the template's runs/eval, under the submission directory
            env={
                "CKPTS": str(ckpts),
                "EVAL_CONFIG": str(REPO / "configs" / "eval" / "quickstart_autoattack.yaml"),
                "PYTHON": sys.executable,
            },
            cwd=tmp_path,
        )
        .stdout.strip()
        .split(";")[0]
    )
    record = cluster.wait(job, timeout=180)[0]
    log = next(tmp_path.glob("eval_*_0.out")).read_text()
    assert record["JobState"] == "COMPLETED", log[-3000:]
    (results_path,) = (tmp_path / "runs" / "eval" / "quickstart_autoattack").glob("*/results.json")
    # named after the checkpoint's path as the README says: no extension, other characters than [A-Za-z0-9._-] '_'
    assert results_path.parent.name == re.sub(r"[^A-Za-z0-9._-]+", "_", str(checkpoint.with_suffix("")))
    results = json.loads(results_path.read_text())
    assert results["test"]["checkpoint"]["path"] == str(checkpoint)
    assert results["autoattack"]["threat_models"]["Linf-4_255"]["num_points"] == 10
    assert (results_path.parent / "autoattack" / "Linf-4_255").is_dir()  # resumable outcomes, in its own directory


def test_the_fixture_says_why_when_slurm_cannot_be_installed(monkeypatch):
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda *args, **kwargs: None)
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match=r"SLURM binaries missing \(munged, .*\) and they cannot be installed"):
        slurm_cluster.install_packages()
