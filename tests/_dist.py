"""Run a function on N ranks on localhost (spawned processes) and collect the results."""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, results, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        # Plain pickle: by value, not torch's shared-memory handles that die with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 180.0, backend: str = "gloo") -> list:
    """``fn(rank, world_size, *args)`` on each rank (``backend`` "nccl": rank r on GPU r);
    returns the results by rank, or raises with every failing rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors, reported = {}, [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                # A rank that died without reporting (crash, failed unpickling) fails the run now.
                dead = [r for r, p in enumerate(procs)
                        if r not in reported and p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"ranks {dead} died without a result (exit codes "
                                  f"{[procs[r].exitcode for r in dead]})")
                    break
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks "
                                  f"{sorted(set(range(world_size)) - reported)}")
                    break
                continue
            reported.add(rank)
            (out.__setitem__(rank, pickle.loads(value)) if ok else errors.append(f"rank {rank}:\n{value}"))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def _serve(rank, world_size, port, inbox, results):
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: where a hung rank waits
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        while (task := inbox.get()) is not None:
            try:
                fn, args = pickle.loads(task)
                results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
            except BaseException:  # noqa: BLE001 - reported to the parent
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks kept alive across calls, so that many cases share one start
    (imports and process-group set-up cost seconds per process): ``run(fn, *args)`` runs
    ``fn(rank, world_size, *args)`` on every rank and returns the results by rank. A call that
    fails closes the pool (a rank that fails while the others wait in a collective hangs them:
    the call then times out first)."""

    def __init__(self, world_size: int, timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size, self.timeout, self.closed = world_size, timeout, False
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [ctx.Process(target=_serve, args=(r, world_size, port, self._inboxes[r], self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args) -> list:
        task = pickle.dumps((fn, args))
        for inbox in self._inboxes:
            inbox.put(task)
        out, errors, deadline, failed_at = {}, [], time.monotonic() + self.timeout, 0.0
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if errors:  # the others may wait for the failed rank in a collective
                    deadline = min(deadline, failed_at + 20)
                if any(p.exitcode is not None for p in self._procs) or time.monotonic() > deadline:
                    self.close()
                    raise AssertionError(f"rank pool of {self.world_size} died or timed out after "
                                         f"{self.timeout}s; results so far: {sorted(out)}, errors: {errors}")
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                failed_at = time.monotonic()
        if errors:  # (its ranks' state is unknown now: the next call gets a fresh pool from RankPools)
            self.close()
            raise AssertionError("\n".join(errors))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        self.closed = True
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    @property
    def alive(self) -> bool:
        return not self.closed and all(p.exitcode is None for p in self._procs)


class RankPools:
    """``RankPool``s by world size (``pools[w].run(fn, *args)``), each started on first use and
    started afresh where the last one died or a call on it failed."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout, self._pools = timeout, {}

    def __getitem__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close()
            pool = self._pools[world_size] = RankPool(world_size, self.timeout)
        return pool

    def close(self) -> None:
        while self._pools:
            self._pools.popitem()[1].close()


def sharded(module, constraints=None, fused_params=None, batch_size=None, sharders=None):
    """``module`` planned by ``KVZCHShardingPlanner`` for this process group's WORLD (CPU, gloo)
    and wrapped in DMP with our sharders (``kvzch_sharders(fused_params)`` unless ``sharders``
    are given): how most multi-rank tests build their model."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv

    from torchrec_kvzch.torchrec import KVZCHShardingPlanner, kvzch_sharders

    world = dist.get_world_size()
    sharders = sharders or kvzch_sharders(fused_params)
    planner = KVZCHShardingPlanner(Topology(world_size=world, compute_device="cpu", local_world_size=world),
                                   batch_size=batch_size, constraints=constraints)
    plan = planner.collective_plan(module, sharders, dist.group.WORLD)
    return DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                    env=ShardingEnv.from_process_group(dist.group.WORLD))


def refusals(*attempts, errors=(ValueError, RuntimeError)) -> list[str]:
    """The messages of the ``attempts`` (callables) that raised one of ``errors``, in order: what
    a rank sends back when a test checks several refusals in one run."""
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except errors as e:
            messages.append(str(e))
    return messages
