"""A replica following training (issue 31): each new delta is applied in the background and
swapped in whole (a request sees the version before or after, never a mix); a damaged delta
is refused naming its file while the version served stays."""

import os
import threading
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import test_resume
from test_resume import flip_a_bit
from test_serving_checkpoint import probe_batch, train_phase
from torchrec_kvzch import AdmissionPolicy
from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.serving.follower import Follower

# Ids without rows read the default row in training's evaluation and in serving alike.
ADMISSION = AdmissionPolicy("count", min_count=2, default="trainable")


def damage(checkpoint: str, fqn: str) -> str:
    """Flip a bit in the first saved chunk of entry ``fqn``; returns its file."""
    storage = FileSystemReader(checkpoint).read_metadata().storage_data
    info = storage[min((i for i in storage if i.fqn == fqn), key=lambda i: tuple(i.offset))]
    flip_a_bit(os.path.join(checkpoint, info.relative_path), info)
    return info.relative_path


class Scores(tuple):
    """(step, scores) comparing scores bit for bit."""

    def __eq__(self, other):
        return self[0] == other[0] and torch.equal(self[1], other[1])


def predict(follower, probe):
    with follower.serving() as version, torch.no_grad():
        return Scores((version.step, version.model(probe)))


def net():
    return test_resume.Net(test_resume.table_params("ttl", admission=ADMISSION))


@pytest.mark.parametrize("spare", [True, False], ids=["spare", "copies"])
def test_a_follower_serves_each_new_delta_whole_and_keeps_serving_through_a_damaged_one(pools, tmp_path, spare):
    """With a spare version (deltas applied to it, the old version catching up once its
    requests leave) and without (a copy per version): the same versions, whole, in order."""
    population = torch.randint(0, test_resume.BUCKETS * test_resume.BUCKET_SIZE, (40,),
                               generator=torch.Generator().manual_seed(0))
    ids = population[torch.arange(30) % 40]
    probe = probe_batch(ids, ids.flip(0), torch.arange(30) % 40)
    root = str(tmp_path)
    first = pools[1].run(train_phase, root, 0, 2, probe, ADMISSION)[0]
    follower = Follower(net, root, spare=spare)
    assert follower.current.step == 2 and not follower.poll()
    assert predict(follower, probe) == (2, first)
    second = pools[1].run(train_phase, root, 2, 4, probe, ADMISSION)[0]
    assert CheckpointManager(root).chain(4) == [2, 4]  # a delta of the version served
    assert not torch.equal(first, second)
    seen, stop, held = [], threading.Event(), []

    def requests():  # each takes a version and uses it to the end
        while not stop.is_set():
            seen.append(predict(follower, probe))

    def long_request():  # holds step 2 across the swap: it must stay step 2 to the end
        with follower.serving() as version, torch.no_grad():
            while follower.current.step != 4:
                time.sleep(0.01)
            held.append((version.step, version.model(probe)))

    readers = [threading.Thread(target=requests), threading.Thread(target=long_request)]
    for reader in readers:
        reader.start()
    while not seen:  # (the long request is in before the swap)
        time.sleep(0.01)
    assert follower.poll()  # returns once the long request is done and the spare caught up
    stop.set()
    for reader in readers:
        reader.join()
    assert follower.current.step == 4 and follower.status()["behind_steps"] == 0
    assert predict(follower, probe) == (4, second) and held[0][0] == 2 and torch.equal(held[0][1], first)
    assert all(s == (2, first) or s == (4, second) for s in seen)

    # Step 6, a delta of 4: with a spare, applied to the version retired at the swap to 4, which
    # must have caught up with step 4 once its requests left.
    third = pools[1].run(train_phase, root, 4, 6, probe, ADMISSION)[0]
    assert follower.poll() and predict(follower, probe) == (6, third)

    pools[1].run(train_phase, root, 6, 8, probe, ADMISSION)  # step 8: a delta of 6; damaged below
    step8 = os.path.join(root, "step-00000008")
    data = damage(step8, "model.ebc.embedding_bags.t.weight")
    assert not follower.poll()
    assert follower.current.step == 6 and "step 8 was not served" in follower.last_error
    assert f"step-00000008/{data} is corrupt" in follower.last_error, follower.last_error
    assert predict(follower, probe) == (6, third)
    status = follower.status()
    assert status["behind_steps"] == 2 and status["lag_s"] > 0 and status["step"] == 6
