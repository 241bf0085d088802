import os

# The suite run inside a cluster job (sbatch, srun, torchrun): the job's launcher variables would make every fit of a
# test take the job's place (Lightning reads SLURM_*, MASTER_PORT, RANK, ...), and the DDP tests running side by side
# would all meet on the job's MASTER_PORT (EADDRINUSE). Tests that need such variables set their own.
LAUNCHER_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
LAUNCHER_VARIABLES |= {"GROUP_RANK", "NODE_RANK", "JSM_NAMESPACE_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"}
for name in list(os.environ):
    if name in LAUNCHER_VARIABLES or name.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_", "PET_")):
        del os.environ[name]

# No network and no W&B in tests.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The cores shared among pytest-xdist's workers (`make test` runs one more than the cores), at most 2 threads each:
# more threads than cores make torch's CPU kernels wait for each other. OMP_NUM_THREADS: the processes tests start.
# Set, not defaulted: xdist's controller process loads this file too, without the worker count, and its workers
# inherit its environment (a default would leave them its 2 threads on 2 shared cores: steps 10 times slower).
THREADS = max(1, min(2, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ["OMP_NUM_THREADS"] = str(THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402 - after OMP_NUM_THREADS, which torch reads when imported

torch.set_num_threads(THREADS)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py
# the tests' reference implementations that `make env` installs outside the environment (see the Makefile)
sys.path.append(str(Path(sys.prefix) / "reference"))

from helpers import tiny_synthetic  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def shared_synthetic_data(tmp_path_factory):
    """The folder of tiny_config's shared synthetic datasets (helpers.SHARED_SYNTHETIC), one per worker."""
    import helpers

    helpers.SHARED_SYNTHETIC = tmp_path_factory.mktemp("shared-synthetic")
    return helpers.SHARED_SYNTHETIC


@pytest.fixture(autouse=True)
def no_job_signal_noted():
    """Each test starts with no job signal noted, as a new process does. A test that stops a command in this process
    leaves its note behind (JobSignals keeps it for the rest of the process), and analyses and evaluations that a
    later test runs without the command line would stop at once."""
    yield
    from robust_lightning.job_signals import JobSignals

    JobSignals.sigterm = JobSignals.requeue = JobSignals.told_others = False


@pytest.fixture(scope="session")
def trained():
    """helpers.train_small_cnn's model, trained once per test process for the attack tests that only run it."""
    from helpers import train_small_cnn

    return train_small_cnn()


@pytest.fixture(scope="session")
def autoattack_checkpoint(tmp_path_factory):
    """A Lightning checkpoint of a tiny classifier fitted to the synthetic val images (a test of the callback,
    not of generalisation: it needs a model that gets most images right and is robust on some)."""
    from lightning import Trainer

    from robust_lightning.data.datamodule import ImageNetDataModule
    from robust_lightning.training.lightning_module import ImageClassifier

    tmp_path = tmp_path_factory.mktemp("aa-fit")
    synthetic_root = tmp_path_factory.mktemp("aa-synthetic")
    data = ImageNetDataModule(source=tiny_synthetic(synthetic_root), image_size=32, eval_batch_size=100, num_workers=0)
    data.prepare_data()
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    x, y = batch["image"].float() / 255, batch["label"]
    torch.manual_seed(0)
    module = ImageClassifier(arch="test_resnet", num_classes=4, image_size=32)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    module.train()
    for _ in range(60):
        optimizer.zero_grad()
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path, synthetic_root


# The longest test files (their summed test times, measured in a full run with three workers on this 2-core machine,
# 2026-11-29) start first, longest first, so that none of them runs alone at the end of `make test` while the other
# workers have nothing left (pytest-xdist's --dist loadfile hands out files in collection order).
LONGEST_FILES = (
    "test_job_errors.py",
    "test_continue_stopped_job.py",
    "test_stop_anywhere.py",
    "test_evaluation_stops.py",
    "test_cli.py",
    "test_autoattack.py",
    "test_ddp.py",
    "test_slurm.py",
    "test_preemption.py",
    "test_gpu_suite.py",
    "test_preemption_ddp.py",
    "test_ddp_commands.py",
    "test_slurm_rank_failure.py",
    "test_adaptive_attacks.py",
    "test_resume_mid_epoch.py",
    "test_slurm_requeue_ddp.py",
    "test_log_continuity.py",
    "test_writers.py",
    "test_evaluate.py",
    "test_torchrun.py",
)


# The test files marked slow: those whose tests took 15 s or more in all when this list was made (the per-file times
# the suite prints, on two busy cores); some have become faster since, and some others slower. test_sweep.py came in
# later, at 62 s. Most start processes (DDP ranks, SLURM jobs, the command) or run attacks against the reference.
# `make test-fast` (-m "not slow") leaves them out for the inner loop; `make test` and CI run them.
SLOW_FILES = (
    "test_adaptive_attacks.py",
    "test_analysis_figures.py",
    "test_autoattack.py",
    "test_autoattack_rand.py",
    "test_benchmark.py",
    "test_benchmarks.py",
    "test_card.py",
    "test_checkpoint_formats.py",
    "test_checkpoint_portability.py",
    "test_checks_through_test.py",
    "test_cli.py",
    "test_cluster_environment.py",
    "test_cluster_log.py",
    "test_compile.py",
    "test_continue_stopped_job.py",
    "test_data_sources.py",
    "test_ddp.py",
    "test_ddp_commands.py",
    "test_dependencies.py",
    "test_evaluate.py",
    "test_evaluation_stops.py",
    "test_export.py",
    "test_fab_untargeted.py",
    "test_gpu_suite.py",
    "test_imagenet_c.py",
    "test_job_errors.py",
    "test_loader_worker_errors.py",
    "test_log_continuity.py",
    "test_log_output.py",
    "test_preemption.py",
    "test_preemption_ddp.py",
    "test_printed_commands.py",
    "test_progress_resume.py",
    "test_quickstart_resume.py",
    "test_recipes.py",
    "test_reference_checks.py",
    "test_resolution.py",
    "test_results_json.py",
    "test_resume_autoattack.py",
    "test_resume_mid_epoch.py",
    "test_run_folders.py",
    "test_slurm.py",
    "test_slurm_rank_failure.py",
    "test_slurm_requeue_ddp.py",
    "test_slurm_restart.py",
    "test_stop_anywhere.py",
    "test_sweep.py",
    "test_synthetic.py",
    "test_torchrun.py",
    "test_uneven_batch.py",
    "test_wandb.py",
    "test_wandb_temp_folders.py",
    "test_writers.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: the rest keep their order
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


# The time each test file took (setup, call and teardown of its tests), printed after the run: the suite's budget
# (the Makefile's test target) is spent per file, and pytest's --durations shows single tests only.
FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    FILE_SECONDS[report.nodeid.split("::")[0]] = FILE_SECONDS.get(report.nodeid.split("::")[0], 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(FILE_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(FILE_SECONDS.values()):8.1f}  in all (summed over the workers)")
