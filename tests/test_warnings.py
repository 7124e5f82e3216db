"""The warnings our own calls used to print (docs/torchrec.md, "Warnings"): TorchRec's default
storage reservation's FutureWarning and log line are silenced around our planner's calls only,
and the docs' examples build their topology the way TorchRec asks."""

import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torchrec.distributed.planner.storage_reservations import (
    FixedPercentageStorageReservation,
    HeuristicalStorageReservation,
)
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_kvzch import KVZCHConstraints, KVZCHTableParams, kvzch_embedding_bag_config, kvzch_sharders
from torchrec_kvzch.torchrec import KVZCHShardingPlanner

ROOT = Path(__file__).resolve().parents[1]
SILENCED = ("HeuristicalStorageReservation is known", "known issue with TorchRec's dense tensor",
            "topology was constructed directly")
RESERVATION_LOGGER = logging.getLogger(HeuristicalStorageReservation.__module__)


def plan(**planner_kwargs):
    params = KVZCHTableParams("user", 16, num_embeddings=2**30, total_num_buckets=8)
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(params, ["f"])], device=torch.device("meta"))
    topology = TopologyFactory.create_topology(TrainerConfig(world_size=2), kernel_config=KernelConfig(compute_device="cpu"))
    planner = KVZCHShardingPlanner(topology, batch_size=64, constraints={"user": KVZCHConstraints(kvzch=params)},
                                   **planner_kwargs)
    planner.plan(ebc, kvzch_sharders())
    return planner


def test_planning_prints_none_of_the_reservations_notices(caplog):
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        plan()
    printed = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in printed if any(s in m for s in SILENCED)], printed
    # Nothing filtered beyond our own calls: no global warning filter, no logger filter left.
    assert warnings.filters == filters_before and not RESERVATION_LOGGER.filters


def test_the_notices_are_torchrecs_and_still_reach_its_own_callers(caplog):
    if not re.search("known to cause issues", Path(sys.modules[HeuristicalStorageReservation.__module__].__file__).read_text()):
        pytest.skip("this TorchRec gives no FutureWarning for its default reservation")
    with pytest.warns(FutureWarning, match="HeuristicalStorageReservation is known"):
        HeuristicalStorageReservation(percentage=0.15)


def test_a_reservation_given_to_the_planner_is_used():
    chosen = FixedPercentageStorageReservation(0.1)
    assert plan(storage_reservation=chosen)._storage_reservation is chosen


@pytest.mark.parametrize("page", ["docs/torchrec.md", "docs/porting.md"])
def test_the_docs_examples_print_none_of_the_silenced_warnings(page):
    code = "\n".join(re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), flags=re.S | re.M))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not [s for s in SILENCED if s in run.stderr], run.stderr[-3000:]
