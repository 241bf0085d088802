"""Progress after a resume: a fit stopped by SIGTERM mid-epoch (its last.ckpt written at that step) and resumed with
``--ckpt_path last`` shows the time since the resume, and the time left from the batches trained since the resume,
in the printed lines of a log and in the tqdm bar of a terminal (issue 37)."""

import re

import yaml

from helpers import run_command, tiny_config

BATCHES = 5  # per epoch; SIGTERM in step 3, so the resumed fit trains batches 4 and 5
PACE = 1.0  # seconds per batch of the resumed fit: at least a second before the first line after the resume


def interrupted_and_resumed(tmp_path, terminal: bool) -> str:
    """The output of the resumed fit, after a fit stopped by SIGTERM in its third step."""
    options = {
        "trainer.enable_progress_bar": True,
        "trainer.log_every_n_steps": 1,
        "trainer.limit_train_batches": BATCHES,
        "trainer.limit_val_batches": 1,
        "data.batch_size": 2,
    }
    signal = {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": 3, "signal_name": "SIGTERM"}}
    first = tiny_config(tmp_path, **options, **{"trainer.callbacks": [signal]})
    stopped = run_command(["fit", "--config", str(first)], cwd=tmp_path, timeout=240)
    assert stopped.returncode == 143, stopped.stdout[-3000:] + stopped.stderr[-3000:]

    config = yaml.safe_load(first.read_text())
    pace = {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(tmp_path / "pace.jsonl"), "seconds": PACE}}
    config["trainer"]["callbacks"] = [pace]
    resume = tmp_path / "resume.yaml"
    resume.write_text(yaml.safe_dump(config))
    resumed = run_command(
        ["fit", "--config", str(resume), "--ckpt_path", "last"], cwd=tmp_path, timeout=240, terminal=terminal
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    return resumed.stdout + ("" if terminal else resumed.stderr)


def seconds(duration: str) -> int:
    """``M:SS``, ``H:MM:SS`` or tqdm's ``MM:SS`` as seconds."""
    total = 0
    for part in duration.split(":"):
        total = total * 60 + int(part)
    return total


def test_the_lines_of_a_log_time_a_resumed_epoch_from_the_resume(tmp_path):
    output = interrupted_and_resumed(tmp_path, terminal=False)
    lines = [line for line in output.splitlines() if re.match(r"(epoch|validation|val) ", line)]
    assert f"epoch 0 resumed at batch 4/{BATCHES}: times count from here" in lines
    # every time shown is the resumed fit's (seconds), not the time since the machine started
    times = [seconds(t) for line in lines for t in re.findall(r"\b\d+:\d\d(?::\d\d)?\b", line)]
    assert times and max(times) < 60, lines
    # the time left after batch 4, from 1 batch in the elapsed time: the same as the elapsed time (1 batch left);
    # counted from the epoch's first batch it would be a quarter of it
    [first] = [line for line in lines if line.startswith(f"epoch 0 batch 4/{BATCHES} ")]
    elapsed, left = re.search(r"\| (\d+:\d\d) \(~(\d+:\d\d) left\)", first).groups()
    assert seconds(elapsed) >= PACE and left == elapsed, first
    assert re.search(r"^epoch 0 done in \d+:\d\d since the resume \|", output, re.M), output[-2000:]


def test_the_bar_of_a_terminal_times_a_resumed_epoch_from_the_resume(tmp_path):
    output = interrupted_and_resumed(tmp_path, terminal=True)
    # Lightning's bar: "Epoch 0:  80%|...| 4/5 [00:03<00:03, 0.33it/s, ...]", the epoch and its total known
    shown = re.findall(rf"Epoch 0: +80%\|[^|]*\| 4/{BATCHES} \[(\d\d:\d\d)<(\d\d:\d\d),", output)
    assert shown, output[-3000:]
    elapsed, left = shown[-1]
    assert PACE <= seconds(elapsed) < 60 and left == elapsed, shown
