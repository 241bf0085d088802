"""Loader workers that never start are started again (robust_lightning/data/worker_start.py).

A child forked while another thread holds Python's runtime lock never runs Python code before Python 3.12 (CPython
gh-112275). Here a fork hook of this test process plays that part: the first forks made after ``HANG`` is set leave a
child that waits forever, before the worker's own start."""

import multiprocessing
import os
import threading

import pytest
import torch
from torch.utils.data import TensorDataset

from robust_lightning.data.worker_start import ATTEMPTS, StartCheckedLoader

HANG = [0]  # the number of forks still to leave hanging in the child


def _hang_in_child() -> None:
    if HANG[0] > 0:
        threading.Event().wait()  # as a child stuck in the fork: it never gets to the worker loop


def _count_in_parent() -> None:
    if HANG[0] > 0:
        HANG[0] -= 1


os.register_at_fork(after_in_child=_hang_in_child, after_in_parent=_count_in_parent)


def loader(**options) -> StartCheckedLoader:
    """Two workers over 12 numbers in an order drawn from a seeded generator."""
    dataset = TensorDataset(torch.arange(12.0))
    result = StartCheckedLoader(
        dataset, batch_size=3, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(7), **options
    )
    result.start_limit = 2.0
    return result


def batches(data: StartCheckedLoader) -> list[torch.Tensor]:
    torch.manual_seed(0)
    got = [batch[0] for batch in data]
    return got + [torch.rand(2)]  # the process's own random state after the epoch


def workers_left() -> list[multiprocessing.Process]:
    return [child for child in multiprocessing.active_children() if child.daemon]


@pytest.fixture(autouse=True)
def no_hang_left():
    yield
    HANG[0] = 0


def test_a_worker_that_never_starts_is_started_again_and_the_epoch_is_the_same():
    expected = batches(loader())
    HANG[0] = 1  # the first worker's fork hangs
    with pytest.warns(UserWarning, match=r"1 of 2 loader workers did not start within 2 s .*gh-112275.*\(2 of 3\)"):
        got = batches(loader())
    assert HANG[0] == 0
    for got_batch, expected_batch in zip(got, expected, strict=True):
        assert torch.equal(got_batch, expected_batch)
    assert not workers_left()  # the stuck child was killed, the others ended with the epoch


def test_workers_that_never_start_stop_the_loader_with_a_clear_error():
    HANG[0] = 2 * ATTEMPTS  # every fork of every attempt hangs
    with pytest.warns(UserWarning, match="did not start"), pytest.raises(RuntimeError, match="did not start in 3"):
        next(iter(loader()))
    assert not workers_left()


def test_the_worker_init_fn_still_runs_once_per_worker(tmp_path):
    def init(worker_id: int) -> None:
        (tmp_path / str(worker_id)).touch()

    assert [batch[0].numel() for batch in loader(worker_init_fn=init)] == [3, 3, 3, 3]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["0", "1"]
