"""A log that is not a terminal (SLURM's .out files, a pipe) gets whole lines: no carriage return and no escape
sequence from any progress bar, each bar still showing its progress as lines (issue 37). On a terminal the bars
stay tqdm's."""

import io
import os

import pytest
from tqdm import tqdm as tqdm_bar

from helpers import eval_config, make_image_tree, run_command, tiny_config
from robust_lightning.console import LineBar, is_terminal, tqdm
from robust_lightning.data.shards import shards_main


def assert_plain(text: str) -> None:
    assert "\r" not in text, [line for line in text.split("\n") if "\r" in line][:3]
    assert "\x1b[" not in text, [line for line in text.split("\n") if "\x1b[" in line][:3]


def test_a_fit_writes_whole_lines_to_a_log(tmp_path):
    """A fit that generates its synthetic data first: the generator's bar and the training display."""
    config = tiny_config(tmp_path, tmp_path / "synthetic", **{"trainer.enable_progress_bar": True})
    result = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_plain(result.stdout + result.stderr)
    assert "synthetic dataset: 100% 2/2 [" in result.stderr
    assert "epoch 0 batch 3/3 |" in result.stdout and "epoch 0 done in " in result.stdout


def test_an_autoattack_evaluation_writes_whole_lines_to_a_log(tmp_path, autoattack_checkpoint):
    ckpt, synthetic_root = autoattack_checkpoint
    config = eval_config(tmp_path, synthetic_root)
    result = run_command(["test", "--config", str(config), "--ckpt_path", str(ckpt)], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_plain(result.stdout + result.stderr)
    # the bar over the test batches and, per batch, the bar over the attacks: lines, the last at 100%
    assert "autoattack: 100% 1/1 [" in result.stderr  # the attacks of a batch (apgd-ce only)
    assert "test done in " in result.stdout


def test_the_shards_converter_writes_whole_lines_to_a_log(tmp_path, capsys):
    src = make_image_tree(tmp_path / "train", {"n01440764": 3, "n01443537": 3})
    args = [str(src), str(tmp_path / "out"), "--prefix", "train", "--samples_per_shard", "2", "--workers", "1"]
    assert shards_main(args) == 0
    printed = capsys.readouterr()
    assert_plain(printed.out + printed.err)
    assert "train shards: 100% 3/3 [" in printed.err


def test_a_bar_is_tqdms_on_a_terminal_and_lines_elsewhere():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        assert is_terminal(terminal)
        bar = tqdm(total=3, file=terminal)
        assert type(bar) is tqdm_bar
        bar.close()
    assert not is_terminal(terminal)  # closed
    os.close(leader)
    assert not is_terminal(io.StringIO())
    assert type(tqdm(total=3, file=io.StringIO())) is LineBar


def test_lines_come_at_the_first_step_at_most_once_an_interval_and_at_the_end(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(LineBar, "clock", staticmethod(lambda: clock[0]))
    log = io.StringIO()
    bar = LineBar(total=100, desc="work", unit="item", file=log, mininterval=0, leave=False, interval=30)
    for step in range(100):
        clock[0] = step * 1.0  # a second a step
        bar.set_postfix_str(f"item {step}", refresh=False)
        bar.update()
        if step == 50:
            bar.write("a message between the lines", file=log)
    bar.close()
    lines = log.getvalue().splitlines()
    assert_plain(log.getvalue())
    counts = [line.split()[2] for line in lines if line.startswith("work:")]
    assert counts == ["1/100", "31/100", "61/100", "91/100", "100/100"]  # the first, every 30 s, the last
    assert "a message between the lines" in lines
    assert all(line.startswith("work:") for line in lines if "message" not in line)


@pytest.mark.parametrize("leave", [True, False])
def test_a_bar_closed_early_ends_with_a_line_of_where_it_stopped(leave):
    log = io.StringIO()
    for item in tqdm(range(10), desc="cut", file=log, leave=leave, mininterval=0):
        if item == 4:
            break
    log_lines = log.getvalue().splitlines()
    assert log_lines[0].startswith("cut:  10% 1/10 [")
    assert log_lines[-1].startswith("cut:  40% 4/10 [")  # the four items done (tqdm counts on the next one)
    assert_plain(log.getvalue())


def test_a_disabled_bar_writes_nothing():
    log = io.StringIO()
    for _ in tqdm(range(3), file=log, disable=True):
        pass
    assert log.getvalue() == ""
