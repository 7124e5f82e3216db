"""Checkpoint folders: committed by a rename, so a save killed at any moment leaves the previous
checkpoint as the latest complete one."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from torchrec_kvzch.checkpoint.manager import CheckpointError, CheckpointManager


def state(value: float) -> dict:
    return {"w": torch.full((1000,), value), "step": torch.tensor(int(value))}


def loaded(manager: CheckpointManager, step=None):
    into = state(-1.0)
    got = manager.load(into, step)
    return got, into


@pytest.mark.parametrize("asynchronous", [False, True])
def test_saves_commit_and_keep_the_last_ones(tmp_path, asynchronous):
    manager = CheckpointManager(tmp_path, keep=2)
    assert manager.latest() is None and manager.load(state(0.0)) is None
    for step in (1, 2, 3):
        manager.save(state(float(step)), step, asynchronous=asynchronous)
    manager.close()
    assert manager.steps() == [2, 3]
    assert not list(tmp_path.glob("*.partial"))
    step, into = loaded(manager)
    assert step == 3 and torch.equal(into["w"], torch.full((1000,), 3.0))
    assert loaded(manager, 2)[1]["step"].item() == 2


def test_load_commits_a_pending_async_save_first(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(state(1.0), 1)
    manager.save(state(2.0), 2, asynchronous=True)
    step, into = loaded(manager)  # no wait(): the load finds step 2 committed all the same
    assert step == 2 and torch.equal(into["w"], torch.full((1000,), 2.0))
    manager.close()


def test_a_save_killed_before_it_completes_leaves_the_previous_checkpoint(tmp_path):
    CheckpointManager(tmp_path).save(state(1.0), 1)
    # A process that dies after writing its data but before DCP writes the metadata.
    script = textwrap.dedent(f"""
        import os, torch
        from torch.distributed.checkpoint import FileSystemWriter
        from torchrec_kvzch.checkpoint.manager import CheckpointError, CheckpointManager
        FileSystemWriter.finish = lambda self, metadata, results: os._exit(3)
        CheckpointManager({str(tmp_path)!r}).save({{"w": torch.full((1000,), 2.0), "step": torch.tensor(2)}}, 2)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 3, run.stderr[-2000:]
    assert (tmp_path / "step-00000002.partial").is_dir()
    manager = CheckpointManager(tmp_path)
    assert manager.steps() == [1]
    step, into = loaded(manager)
    assert step == 1 and torch.equal(into["w"], torch.full((1000,), 1.0))
    manager.save(state(2.0), 2)  # the same step again replaces the dead attempt
    assert manager.steps() == [1, 2] and not (tmp_path / "step-00000002.partial").exists()


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="keep at least 1"):
        CheckpointManager(tmp_path, keep=0)
    with pytest.raises(ValueError, match="full_every=0; use 1"):
        CheckpointManager(tmp_path, full_every=0)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        CheckpointManager(tmp_path).load(state(0.0), 7)


def test_a_missing_root_is_said_and_changes_nothing(tmp_path):
    """A mistyped path must not pass for a first run in silence: the load names it."""
    typo = tmp_path / "chekpoints"
    into = state(-1.0)
    with pytest.warns(UserWarning, match=f"{typo} does not exist, so nothing was loaded"):
        assert CheckpointManager(typo).load(into) is None
    assert torch.equal(into["w"], torch.full((1000,), -1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a root that exists and is empty: a first run, quietly
        assert CheckpointManager(tmp_path).load(into) is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        CheckpointManager(typo).load(into, 3)  # a step asked for by name must exist


def test_a_failed_load_raises_an_exception_whose_first_line_is_the_cause(tmp_path):
    """DCP's CheckpointException is a BaseException that begins with a traceback; the manager
    raises CheckpointError, an Exception that begins with the failing rank's message."""
    manager = CheckpointManager(tmp_path)
    manager.save(state(1.0), 1)
    into = {"w": torch.zeros(10), "step": torch.tensor(0)}
    with pytest.raises(Exception) as caught:  # `except Exception` catches it
        manager.load(into)
    error = caught.value
    assert isinstance(error, CheckpointError) and set(error.failures) == {0}
    first, second = str(error).splitlines()[:2]
    assert first.startswith("ValueError: Size mismatch") and "for w" in first
    assert second == f"(load of {manager.path(1)} failed on rank 0)"
    assert torch.equal(into["w"], torch.zeros(10))
