"""The training job end to end: train -> checkpoint -> resume at another world size, a save killed
half-way, a dead rank, the Criteo path, and the data it trains on."""

import importlib.metadata
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.torchrec.config import load_config
from torchrec_kvzch.job.data import CriteoClickLog, SyntheticClickLog
from torchrec_kvzch.job import config_path
from torchrec_kvzch.job.cli import UsageError, check_args, job_config, parse_args
from torchrec_kvzch.job.train import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(config_path("quickstart"))
SMALL = ["--config", QUICKSTART, "--global-batch-size", "256", "--population", "3000", "--log-every", "2"]


def train(run_dir, *args, nproc=2, summary="summary.json", check=True, env=None, timeout=240):
    """Run the job as a user would; returns (completed process, summary or None)."""
    cmd = [sys.executable, "-m", "torchrec_kvzch.job.train", *SMALL, "--nproc", str(nproc),
           "--run-dir", str(run_dir), "--summary", str(run_dir / summary), *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"{cmd} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    path = run_dir / summary
    return done, (json.loads(path.read_text()) if path.is_file() else None)


def steps_on_disk(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def metrics(run_dir, kind="train"):
    """The run directory's metrics lines of one kind: "train" (log steps) or "eval"."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["kind"] == kind]


def test_train_checkpoint_resume_on_fewer_ranks_continues_exactly(tmp_path):
    # 2 ranks to step 8, then 1 rank from that checkpoint to step 12 ...
    _, first = train(tmp_path / "run", "--steps", 8, "--checkpoint-every", 4, "--async-checkpoint")
    assert first["end_step"] == 8 and steps_on_disk(tmp_path / "run") == ["step-00000004", "step-00000008"]
    assert all(sum(rows) > 0 for rows in first["rows_per_rank"].values())
    assert all(len(rows) == 2 and min(rows) > 0 for rows in first["rows_per_rank"].values())
    _, second = train(tmp_path / "run", "--steps", 12, nproc=1, summary="resumed.json")
    assert second["resumed_from"] == 8 and second["start_step"] == 8 and second["end_step"] == 12
    # ... predicts exactly what the saved model predicted: rows, optimizer state, dense weights.
    assert second["probe_after_resume"] == first["probe_final"]
    # ... and trains on as an uninterrupted 2-rank run does (same data, same state).
    done, straight = train(tmp_path / "straight", "--steps", 12, "--checkpoint-every", 0)
    # The stores' counters, per table over all ranks, in the metrics and on the progress bar.
    last = metrics(tmp_path / "straight")[-1]
    for table in ("user", "item"):
        assert last["inserted"][table] == last["live_rows"][table] > 0  # nothing evicted here
        assert last["evicted"][table] == 0 and last["bytes"][table] > 0
    assert f"ins={sum(last['inserted'].values()):,}" in done.stderr and "evict=0" in done.stderr
    resumed_curve = {m["step"]: m["loss"] for m in metrics(tmp_path / "run")}
    straight_curve = {m["step"]: m["loss"] for m in metrics(tmp_path / "straight")}
    assert resumed_curve.keys() == straight_curve.keys() == {2, 4, 6, 8, 10, 12}
    for step, loss in straight_curve.items():
        assert resumed_curve[step] == pytest.approx(loss, rel=1e-4), step
    assert straight_curve[12] < straight_curve[2]  # the signal is learnable
    # A config whose tables no longer match the checkpoint is refused, naming the table, once,
    # without tracebacks (kept in the run directory) and without advice to rerun.
    narrow = tmp_path / "narrow.yaml"
    narrow.write_text(Path(QUICKSTART).read_text().replace("embedding_dim: 32", "embedding_dim: 16"))
    done, _ = train(tmp_path / "run", "--config", narrow, "--steps", 14, summary="narrow.json", check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    report = done.stderr[done.stderr.index("training failed"):]
    assert report.startswith("training failed on ranks 0, 1: CheckpointError: ValueError: ")
    assert "KV-ZCH table 'item' was saved with embedding_dim 32 (fp32), this model has 16" in report
    assert report.count("was saved with embedding_dim") == 1 and "rerun" not in report
    # (what comes before the report is the libraries' own import-time warnings: fbgemm 1.6, on the
    # torch 2.11 stack, warns at every import that its compatibility table lacks its own version)
    before = done.stderr[: done.stderr.index("training failed")]
    assert "Traceback" not in done.stderr and len(report.splitlines()) < 6, done.stderr
    assert "torchrec_kvzch" not in before and "KV-ZCH" not in before, before
    assert "Traceback" in json.loads((tmp_path / "run" / "failures" / "rank-1.json").read_text())["traceback"]


def test_the_pipeline_and_evaluations_change_nothing_the_plain_loop_computes(tmp_path):
    """The job trains through TorchRec's TrainPipelineSparseDist; a plain loop that also
    evaluates on the held-out slice every 2 steps computes the same losses and model."""
    _, piped = train(tmp_path / "piped", "--steps", 8, "--checkpoint-every", 0, "--eval-every", 0)
    _, plain = train(tmp_path / "plain", "--steps", 8, "--checkpoint-every", 0, "--eval-every", 2,
                     "--pipeline", "none")
    assert piped["pipeline"] == "sparse-dist" and plain["pipeline"] == "none"
    assert plain["loss_curve"] == piped["loss_curve"] and plain["probe_final"] == piped["probe_final"]
    assert piped["eval"] == [] and [e["step"] for e in plain["eval"]] == [2, 4, 6, 8]
    assert all(0.5 < e["auc"] < 1 and 0 < e["ne"] < 1.2 and e["examples"] == 512 for e in plain["eval"])
    assert [m["step"] for m in metrics(tmp_path / "plain", "eval")] == [2, 4, 6, 8]


def test_every_run_keeps_its_summary_and_draws_the_run_so_far(tmp_path):
    run = tmp_path / "run"
    done, first = train(run, "--steps", 4, "--checkpoint-every", 2, "--eval-every", 2)
    assert f"no checkpoint under {run / 'checkpoints'}: starting fresh" in done.stdout
    assert "planned memory per rank" in done.stdout and "trained steps 0 -> 4" in done.stdout
    assert "trained steps" not in done.stderr  # the plan and summary are on stdout, the bar on stderr
    done, second = train(run, "--steps", 6, "--eval-every", 2, nproc=1)
    assert f"resumed from {run / 'checkpoints' / 'step-00000004'}" in done.stdout
    runs = [json.loads(line) for line in (run / "runs.jsonl").read_text().splitlines()]
    assert [(r["start_step"], r["end_step"], r["world_size"]) for r in runs] == [(0, 4, 2), (4, 6, 1)]
    assert runs[0]["probe_final"] == first["probe_final"] == second["probe_after_resume"]
    for s in (first, second):
        assert s["versions"]["torchrec_kvzch"] == importlib.metadata.version("torchrec-kvzch")
        assert s["config_yaml"] == Path(QUICKSTART).read_text()
        assert [step for step, _ in s["loss_curve"]] == list(range(s["start_step"] + 2, s["end_step"] + 1, 2))
        assert s["totals"]["inserted"]["user"] > 0 and s["totals"]["evicted"] == {"user": 0, "item": 0}
    assert second["plot"] == str(run / "metrics.png") and (run / "metrics.png").stat().st_size > 10_000


def test_a_run_started_below_the_latest_checkpoint_retires_the_later_ones(tmp_path):
    """``--resume none`` (or an older step) starts another run in the folder: the later
    checkpoints are another run's, moved aside (not deleted), so that a plain rerun resumes
    this run's latest and ``--keep`` counts this run's."""
    run = tmp_path / "run"
    train(run, "--steps", 6, "--checkpoint-every", 2, "--seed", 1, nproc=1)
    assert steps_on_disk(run) == ["step-00000004", "step-00000006"]
    done, fresh = train(run, "--steps", 3, "--checkpoint-every", 2, "--seed", 2, "--resume", "none", nproc=1)
    assert "--resume none: starting fresh" in done.stdout and "checkpoints [4, 6] are later" in done.stdout
    [aside] = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("retired-")]
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000004", "step-00000006"]
    assert [s for s in steps_on_disk(run) if s.startswith("step-")] == ["step-00000002", "step-00000003"]
    done, again = train(run, "--steps", 4, "--checkpoint-every", 2, "--seed", 2, nproc=1)
    assert again["resumed_from"] == 3 and again["probe_after_resume"] == fresh["probe_final"]


def test_a_dry_run_prints_the_plan_and_memory_per_rank_and_starts_nothing(tmp_path, capsys):
    assert main(["--config", QUICKSTART, "--nproc", "4", "--dry-run", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "dram_virtual_table" in out and "rank:3/cpu" in out and "planned memory per rank" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+[0-3]\s+[\d.,]+\s+[\d.,]+$", line)]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and all(float(r[1].replace(",", "")) > 0 for r in rows)
    assert not (tmp_path / "run").exists()


def test_a_config_typo_is_one_line_with_a_suggestion(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text(Path(QUICKSTART).read_text().replace("embedding_dim: 32", "embeding_dim: 32"))
    assert main(["--config", str(typo), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {typo}: table_defaults.embeding_dim: unknown key; did you mean "
                                        "'embedding_dim'? allowed: embedding_dim, features, kvzch, num_embeddings, "
                                        "planner, pooling"]


def test_admission_counters_come_from_every_table(monkeypatch):
    """The progress bar and metrics count admission when any table has it, not only the first."""
    from types import SimpleNamespace

    from torchrec_kvzch.job import model as job_model
    shard = lambda **c: SimpleNamespace(store=SimpleNamespace(counters={"rows": 1, "inserted": 1, "evicted": 0,  # noqa: E731
                                                                         "bytes": 8, **c}))
    monkeypatch.setattr(job_model, "kvzch_tables", lambda model: [("user", shard()),
                                                                   ("item", shard(admitted=5, rejected=7))])
    counters = job_model.store_counters(None)
    assert counters["admitted"] == [0, 5] and counters["rejected"] == [0, 7]
    monkeypatch.setattr(job_model, "kvzch_tables", lambda model: [("user", shard())])
    assert "admitted" not in job_model.store_counters(None)


def test_admission_through_the_job_saves_its_state_and_resumes_exactly(tmp_path):
    """``--admission``: fewer rows than without, counters in the metrics, and a resume at the
    same world size predicts exactly what the saved model did."""
    _, plain = train(tmp_path / "plain", "--steps", 6, "--checkpoint-every", 0)
    _, first = train(tmp_path / "run", "--steps", 6, "--checkpoint-every", 3, "--admission", "count:2:trainable")
    rows = lambda s: sum(sum(r) for r in s["rows_per_rank"].values())  # noqa: E731
    assert 0 < rows(first) < rows(plain)
    last = metrics(tmp_path / "run")[-1]
    assert sum(last["admitted"].values()) > 0 and sum(last["rejected"].values()) > 0
    _, second = train(tmp_path / "run", "--steps", 8, "--admission", "count:2:trainable", summary="resumed.json")
    assert second["resumed_from"] == 6 and second["probe_after_resume"] == first["probe_final"]


def test_incremental_checkpoints_through_the_job_resume_exactly_at_another_world_size(tmp_path):
    """``--incremental-every`` (with admission, async saves): deltas between full checkpoints,
    smaller than them. The run resumes from the last delta on 1 rank predicting exactly what
    the saved model did and saves deltas of it; a chain saved partly at 2 ranks and partly at
    1 then resumes at 2 as exactly."""
    flags = ["--checkpoint-every", 4, "--incremental-every", 2, "--keep", 1, "--admission", "count:2"]
    _, first = train(tmp_path / "run", "--steps", 9, *flags, "--async-checkpoint")
    assert steps_on_disk(tmp_path / "run") == ["step-00000008", "step-00000009"]
    assert first["checkpoint_chain"] == [8, 9]
    full, delta = first["checkpoint_chain_bytes"]
    assert delta < full
    _, second = train(tmp_path / "run", "--steps", 11, *flags, nproc=1, summary="resumed.json")
    assert second["resumed_from"] == 9 and second["probe_after_resume"] == first["probe_final"]
    assert second["checkpoint_chain"] == [8, 9, 10, 11]  # deltas of a 2-rank chain, saved at 1
    _, third = train(tmp_path / "run", "--steps", 12, *flags, summary="third.json")
    assert third["resumed_from"] == 11 and third["probe_after_resume"] == second["probe_final"]
    assert third["checkpoint_chain"] == [12]
    with pytest.raises(UsageError, match="not a multiple of --incremental-every 3"):
        check_args(parse_args(["--config", QUICKSTART, "--incremental-every", "3"]), 2)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    done, _ = train(run, "--steps", 8, "--checkpoint-every", 4, "--crash-drill", "0:8:save", check=False)
    assert done.returncode == 1 and time.monotonic() - t0 < 120
    assert "rank 0: killed by SIGKILL" in done.stderr and "rerun the same command to resume" in done.stderr
    assert steps_on_disk(run) == ["step-00000004", "step-00000008.partial"]
    _, resumed = train(run, "--steps", 8, nproc=1)
    assert resumed["resumed_from"] == 4 and resumed["end_step"] == 8
    assert steps_on_disk(run) == ["step-00000004", "step-00000008"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_rank_stops_the_others_with_a_clear_error(tmp_path):
    # Under the job's own launcher: the launcher stops the survivors and names the dead rank.
    done, _ = train(tmp_path / "launched", "--steps", 20, "--checkpoint-every", 2, "--crash-drill", "1:3", check=False)
    assert done.returncode == 1 and done.stderr.rstrip().splitlines()[-1] == (
        f"training failed (rank 1: killed by SIGKILL); complete checkpoints: [2] under {tmp_path / 'launched' / 'checkpoints'}; "
        "rerun the same command to resume from the latest."), done.stderr[-3000:]
    assert done.stderr.count("rerun") == 1 and "Terminating process" not in done.stderr  # (said once, and only by us)
    # Ranks started separately (as on two machines), with no launcher to stop them: the
    # survivor's collective fails and it exits on its own, naming the cause and the checkpoints.
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "torchrec_kvzch.job.train", *SMALL, "--steps", "20", "--checkpoint-every", "2",
               "--run-dir", str(tmp_path / "nodes"), "--crash-drill", "1:3", "--timeout-s", "60"]
        procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env))
    t0 = time.monotonic()
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert time.monotonic() - t0 < 150
    assert procs[1].returncode == -9 and procs[0].returncode != 0
    assert "another rank died or stalled" in errors[0] and "stalled; complete checkpoints: [2]" in errors[0], errors[0][-3000:]


def test_a_second_job_on_a_run_dir_in_use_is_refused_before_it_writes_anything(tmp_path):
    """Two jobs on one run dir mixed their checkpoints, metrics and failure records (and one of
    them died in a save). The lock is the OS's: a holder killed by SIGKILL leaves none behind."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from torchrec_kvzch.job.train import run_dir_lock\n"
                               f"with run_dir_lock(__import__('pathlib').Path({str(run)!r})):\n"
                               "    print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        done, _ = train(run, "--steps", 2, nproc=1, check=False)
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
            f"error: --run-dir {run} is in use by pid {holder.pid} on {socket.gethostname()}, a job training there; "
            "wait for it to end, or give this run another --run-dir")
        assert [p.name for p in run.iterdir()] == ["LOCK"]
    finally:
        holder.kill()
        holder.wait()
    _, summary = train(run, "--steps", 2, "--eval-every", 0, nproc=1)
    assert summary["end_step"] == 2


@pytest.mark.parametrize("sig, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_says_where_to_resume_from_in_one_line(tmp_path, sig, to_group):
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM to the launcher: one line with
    the checkpoints and the advice, the shell's status for the signal, no launcher traceback."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torchrec_kvzch.job.train", *SMALL, "--nproc", "1", "--steps", "100000",
           "--checkpoint-every", "2", "--eval-every", "0", "--run-dir", str(run)]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not CheckpointManager(run / "checkpoints").steps():  # (--keep 2 prunes older steps fast: any one)
        if job.poll() is not None or time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)  # (else reading its stderr waits for it forever)
            pytest.fail(f"no checkpoint from {cmd}:\n{job.communicate()[1][-3000:]}")
        time.sleep(0.2)
    os.killpg(job.pid, sig) if to_group else job.send_signal(sig)
    err = job.communicate(timeout=120)[1]
    assert job.returncode == 128 + sig, err[-3000:]
    steps = [int(p.name[5:]) for p in sorted((run / "checkpoints").iterdir()) if (p / ".metadata").is_file()]
    assert err.rstrip().splitlines()[-1] == (f"interrupted ({sig.name}); complete checkpoints: {steps} under "
                                             f"{run / 'checkpoints'}; rerun the same command to resume from the latest")
    assert "Traceback" not in err and "leaked" not in err and "SignalException" not in err, err[-3000:]


def test_a_stalled_rank_is_reported_by_the_survivors_message_alone(tmp_path):
    """No rank killed: a survivor's failed collective says why, and where to resume from, once."""
    from types import SimpleNamespace

    from torchrec_kvzch.job.train import failure_report
    lost = "PeerLost: rank 1: a collective failed at step 5 (...); another rank died or stalled. Complete " \
           "checkpoints: [4] under run/checkpoints; rerun the same command to resume from the latest."
    (tmp_path / "failures").mkdir()
    (tmp_path / "failures" / "rank-1.json").write_text(json.dumps({"rank": 1, "crash": True, "error": lost}))
    failed = SimpleNamespace(failures={1: SimpleNamespace(exitcode=1)})
    assert failure_report(tmp_path, failed) == f"training failed (rank 1: exit code 1): {lost}"


def write_criteo_tsv(path, rows, seed=0):
    rng = random.Random(seed)
    pools = [[format(rng.getrandbits(32), "08x") for _ in range(rng.randint(3, 60))] for _ in range(26)]
    with open(path, "w") as f:
        for _ in range(rows):
            dense = [str(rng.randint(0, 50)) if rng.random() > 0.1 else "" for _ in range(13)]
            cats = [rng.choice(pool) if rng.random() > 0.05 else "" for pool in pools]
            f.write("\t".join([str(rng.randint(0, 1)), *dense, *cats]) + "\n")


CRITEO_CONFIG = """
optimizer: {type: exact_rowwise_adagrad, learning_rate: 0.05}
tables:
""" + "".join(f"""  - name: t{c}
    embedding_dim: 8
    features: [cat_{c}]
    kvzch: {{num_embeddings: 2^32, total_num_buckets: 16, expected_rows: 1000}}
""" for c in (0, 7, 25))


def test_criteo_tsv_gives_every_hash_its_own_row(tmp_path):
    tsv = tmp_path / "day_0.tsv"
    write_criteo_tsv(tsv, 300)
    (tmp_path / "criteo.yaml").write_text(CRITEO_CONFIG)
    run = tmp_path / "run"
    cmd_args = ["--config", tmp_path / "criteo.yaml", "--criteo", tsv, "--eval-every", 0, "--steps", 4,
                "--global-batch-size", 64]
    _, summary = train(run, *cmd_args)
    assert summary["data"] == "criteo" and summary["end_step"] == 4
    # Steps 0-3 and the probe read the first 256 lines: one row per distinct hash, no collisions.
    lines = [line.rstrip("\n").split("\t") for line in tsv.read_text().splitlines()[:256]]
    for c in (0, 7, 25):
        distinct = {int(line[14 + c] or "0", 16) for line in lines}
        assert sum(summary["rows_per_rank"][f"t{c}"]) == len(distinct)
    assert list((run / "criteo_cache").glob("*_sparse.npy"))  # converted once, then reused
    _, again = train(run, *cmd_args[:-4], "--steps", 6, "--global-batch-size", 64, nproc=1, summary="again.json")
    assert again["resumed_from"] == 4


def test_a_malformed_criteo_line_is_named_by_file_line_and_fix(tmp_path):
    """TorchRec's converter raised a bare IndexError (or ValueError) from inside a datapipe."""
    (tmp_path / "criteo.yaml").write_text(CRITEO_CONFIG)
    tsv = tmp_path / "day_0.tsv"
    write_criteo_tsv(tsv, 1200)
    lines = tsv.read_text().splitlines(keepends=True)
    fix = "; a Criteo line has 40 tab-separated columns (a label, 13 integers, 26 hexadecimal ids, any of them " \
          "empty); fix or drop the line"
    # past the lines checked before launch: named when the conversion fails on it
    tsv.write_text("".join(lines[:1100] + ["1\t2\n"] + lines[1101:]))
    with pytest.raises(ValueError, match=re.escape(f"{tsv}: line 1101: 2 tab-separated columns{fix}")):
        CriteoClickLog(load_config(tmp_path / "criteo.yaml"), [str(tsv)], tmp_path / "cache", 64)
    # among the first lines: refused before anything starts
    tsv.write_text("".join(lines[:3] + ["1\tx" + lines[3][lines[3].index("\t", 2):]] + lines[4:]))
    with pytest.raises(UsageError, match=re.escape(f"{tsv}: line 4: column 2 holds 'x', not a number{fix}")):
        check_args(parse_args(["--config", str(tmp_path / "criteo.yaml"), "--criteo", str(tsv)]), 2)


def test_criteo_refuses_features_it_does_not_have(tmp_path):
    tsv = tmp_path / "day_0.tsv"
    write_criteo_tsv(tsv, 10)
    with pytest.raises(ValueError, match=r"\['user_id', 'item_id', 'category'\] are not Criteo columns.*--config criteo"):
        CriteoClickLog(load_config(QUICKSTART), [str(tsv)], tmp_path, 4)


@settings(max_examples=10)
@given(step=st.integers(0, 10**6), world_size=st.integers(1, 8), seed=st.integers(0, 100))
def test_synthetic_batches_do_not_depend_on_the_world_size(step, world_size, seed):
    log = SyntheticClickLog(load_config(QUICKSTART), 8 * 7 * 5 * 3, seed=seed, population=1000)
    whole = log.batch(step)
    parts = [log.batch(step, r, world_size) for r in range(world_size)] if 840 % world_size == 0 else None
    if parts is None:
        with pytest.raises(ValueError, match="not divisible by the world size"):
            log.batch(step, 0, world_size)
        return
    for key in whole.sparse_features.keys():
        joined = torch.cat([p.sparse_features[key].values() for p in parts])
        assert torch.equal(joined, whole.sparse_features[key].values())
    assert torch.equal(torch.cat([p.dense_features for p in parts]), whole.dense_features)
    assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)


@pytest.mark.parametrize("alpha", [1.0, float("nan"), float("inf")])
def test_synthetic_log_refuses_a_zipf_exponent_it_cannot_draw_from(alpha):
    """NaN and infinity made every Zipf draw rank 0: a log of one id per feature, silently."""
    with pytest.raises(ValueError, match=f"zipf_alpha={alpha}, .*need a finite alpha > 1"):
        SyntheticClickLog(load_config(QUICKSTART), 64, zipf_alpha=alpha)


def test_synthetic_log_is_skewed_grows_and_carries_a_signal():
    config = load_config(QUICKSTART)
    log = SyntheticClickLog(config, 4096, population=10_000, new_id_fraction=0.05)
    batches = [log.batch(s) for s in range(20)]
    users = torch.cat([b.sparse_features["user_id"].values() for b in batches])
    assert (users >= 0).all() and (users < 2**40).all()
    _, counts = users.unique(return_counts=True)
    assert counts.max() > 100 * counts.float().median()  # Zipf: a few ids dominate
    seen, new_per_step = set(), []
    for b in batches:
        ids = set(b.sparse_features["user_id"].values().tolist())
        new_per_step.append(len(ids - seen))
        seen |= ids
    assert min(new_per_step[5:]) >= 0.04 * 4096  # fresh ids keep arriving
    categories = torch.cat([b.sparse_features["category"].values() for b in batches])
    assert categories.max() < 1024
    # Labels follow the per-id effect: the most clicked popular users beat the least clicked.
    labels = torch.cat([b.labels for b in batches])
    ids, inverse, counts = users.unique(return_inverse=True, return_counts=True)
    rate = torch.zeros(len(ids)).index_add_(0, inverse, labels) / counts
    popular = counts >= 50
    assert rate[popular].max() - rate[popular].min() > 0.3


def test_bad_command_lines_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(UsageError, match="not divisible by the world size 3"):
        check_args(parse_args(["--config", QUICKSTART, "--nproc", "3"]), 3)
    with pytest.raises(UsageError, match="expected RANK:STEP"):
        check_args(parse_args(["--config", QUICKSTART, "--crash-drill", "1"]), 2)
    with pytest.raises(UsageError, match="--resume 'latest'"):
        check_args(parse_args(["--config", QUICKSTART, "--resume", "latest"]), 2)
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(Path(QUICKSTART).read_text().replace("- name: category  # an ordinary table (fbgemm's FUSED kernel)\n",
                                                          "- name: category\n    embedding_dim: 16\n"))
    with pytest.raises(UsageError, match="one embedding_dim for all tables.*category=16"):
        check_args(parse_args(["--config", str(mixed)]), 2)
    for spec in ("count", "count:1", "probability:2", "count:2:mean", "lottery:3"):
        with pytest.raises(UsageError, match=f"--admission '{spec}': expected count:N or probability:P"):
            check_args(parse_args(["--config", QUICKSTART, "--admission", spec]), 2)
    sketched = tmp_path / "sketched.yaml"  # --admission sets the rule; the config's sketch size stays
    sketched.write_text(Path(QUICKSTART).read_text().replace(
        "    total_num_buckets: 64\n",
        "    total_num_buckets: 64\n    admission: {kind: count, min_count: 3, sketch_width: 65536, sketch_depth: 2}\n", 1))
    config = job_config(parse_args(["--config", str(sketched), "--admission", "count:2"]))
    admission = next(t.kvzch.admission for t in config.tables if t.kvzch is not None)
    assert (admission.min_count, admission.sketch_width, admission.sketch_depth) == (2, 65536, 2)
    with pytest.raises(Exception, match="no such sharding config"):
        check_args(parse_args(["--config", str(tmp_path / "missing.yaml")]), 2)
    few = tmp_path / "few.yaml"
    few.write_text(Path(QUICKSTART).read_text().replace("total_num_buckets: 64", "total_num_buckets: 2"))
    with pytest.raises(ValueError, match=r"KV-ZCH table 'user': total_num_buckets \(2\) is smaller than the world size \(4\)"):
        check_args(parse_args(["--config", str(few), "--nproc", "4"]), 4)
    cached = tmp_path / "cached.yaml"
    cached.write_text(Path(QUICKSTART).read_text().replace("    init_range: [-0.05, 0.05]\n",
                                                           "    init_range: [-0.05, 0.05]\n    device_cache: {load_factor: 0.2}\n"))
    with pytest.raises(UsageError, match="table.s. user, item set device_cache.*use --device cuda .* or drop device_cache"):
        check_args(parse_args(["--config", str(cached), "--device", "cpu"]), 2)
    with pytest.raises(UsageError, match="--nproc 0: launch at least 1 process"):
        check_args(parse_args(["--config", QUICKSTART, "--nproc", "0"]), 0)
    with pytest.raises(UsageError, match="--crash-drill '5:2': rank 5 does not exist in a run of 2 rank.s.; use a rank below 2"):
        check_args(parse_args(["--config", QUICKSTART, "--crash-drill", "5:2"]), 2)
    with pytest.raises(UsageError, match="--crash-drill '0:9': step 9 is never trained by a run to --steps 9"):
        check_args(parse_args(["--config", QUICKSTART, "--crash-drill", "0:9", "--steps", "9"]), 2)
    fresh = ["--config", QUICKSTART, "--run-dir", str(tmp_path / "fresh")]
    check_args(parse_args([*fresh, "--crash-drill", "0:9:save", "--steps", "9"]), 2)
    with pytest.raises(UsageError, match="--crash-drill '0:4': this run resumes at step 5, so step 4 never comes"):
        check_args(parse_args([*fresh, "--crash-drill", "0:4", "--resume", "5"]), 2)
    (tmp_path / "fresh" / "checkpoints" / "step-00000006").mkdir(parents=True)  # (what resume auto finds)
    (tmp_path / "fresh" / "checkpoints" / "step-00000006" / ".metadata").touch()
    with pytest.raises(UsageError, match="resumes at step 6, so step 6 never comes; use a later step, or --resume none"):
        check_args(parse_args([*fresh, "--crash-drill", "0:6:save"]), 2)
    check_args(parse_args([*fresh, "--crash-drill", "0:6:save", "--resume", "none"]), 2)
    with pytest.raises(UsageError, match=r"--new-id-fraction 2.0: must be in \[0, 1\)"):
        check_args(parse_args(["--config", QUICKSTART, "--new-id-fraction", "2"]), 2)
    # Numbers out of range (NaN and infinity too), each named with its fix; they failed in the workers
    for option, value, message in [
            ("--threads", "-3", "use a positive count, or 0 for the cores"),
            ("--timeout-s", "0", "use a positive, finite number of seconds"),
            ("--timeout-s", "inf", "use a positive, finite number of seconds"),
            ("--population", "0", "use at least 1 id per feature"),
            ("--zipf-alpha", "1", "use a finite exponent above 1"),
            ("--zipf-alpha", "nan", "use a finite exponent above 1"),
            ("--zipf-alpha", "inf", "use a finite exponent above 1"),
            ("--dense-lr", "-1", "use a finite learning rate >= 0"),
            ("--dense-lr", "nan", "use a finite learning rate >= 0"),
            ("--seed", "8388608", r"use a seed in \[0, 8388608\)"),
            ("--criteo", str(tmp_path / "day_0.tsv"), "no such file .*day_0.tsv; give the paths of Criteo TSV files")]:
        with pytest.raises(UsageError, match=f"^{option}.*{message}"):
            check_args(parse_args(["--config", QUICKSTART, option, value]), 2)
    (tmp_path / "afile").touch()
    with pytest.raises(UsageError, match="--run-dir .*afile is a file; give a folder"):
        check_args(parse_args(["--config", QUICKSTART, "--run-dir", str(tmp_path / "afile")]), 2)
    # One line, exit status 2, as argparse's own errors (and a config's), dry run or not.
    assert main(["--config", QUICKSTART, "--global-batch-size", "100", "--nproc", "3", "--dry-run"]) == 2
    assert main(["--config", QUICKSTART, "--zipf-alpha", "nan", "--dry-run"]) == 2


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_device_auto_takes_a_gpu_per_process_or_the_cpu(monkeypatch, gpus):
    """Each process on the machine needs a GPU of its own: 'auto' on a machine with fewer GPUs
    than processes trains on the CPU; an explicit 'cuda' there is refused with the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = parse_args(["--config", QUICKSTART, "--nproc", "2"])
    check_args(args, 2)
    assert args.device == ("cuda" if gpus >= 2 else "cpu")
    if gpus < 2:
        fix = "--nproc 1 or fewer, or --device cpu" if gpus else "use --device cpu"
        with pytest.raises(UsageError, match=f"2 process.*need one GPU each and it has {gpus}; .*{fix}"):
            check_args(parse_args(["--config", QUICKSTART, "--nproc", "2", "--device", "cuda"]), 2)
    else:
        cuda = parse_args(["--config", QUICKSTART, "--nproc", "2", "--device", "cuda"])
        check_args(cuda, 2)
        assert cuda.device == "cuda"
    cpu = parse_args(["--config", QUICKSTART, "--nproc", "2", "--device", "cpu"])
    check_args(cpu, 2)
    assert cpu.device == "cpu"


def test_console_script_is_installed():
    try:
        importlib.metadata.distribution("torchrec-kvzch")
    except importlib.metadata.PackageNotFoundError:  # on PYTHONPATH only (the offline GPU kit)
        pytest.skip("torchrec-kvzch is not installed as a package here")
    script = Path(sys.executable).parent / "torchrec-kvzch-train"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--checkpoint-every" in done.stdout and "--crash-drill" in done.stdout


def test_held_out_examples_are_never_trained_on(tmp_path):
    # Criteo: the last --eval-batches global batches of the files. Column cat_0 numbers the lines.
    tsv = tmp_path / "day_0.tsv"
    tsv.write_text("".join("\t".join(["1", *["1"] * 13, format(line, "08x"), *["0"] * 25]) + "\n" for line in range(300)))
    (tmp_path / "criteo.yaml").write_text(CRITEO_CONFIG)
    log = CriteoClickLog(load_config(tmp_path / "criteo.yaml"), [str(tsv)], tmp_path / "cache", 64, heldout_batches=1)
    trained = torch.cat([log.batch(step, r, 2).sparse_features["cat_0"].values() for step in range(20) for r in (0, 1)])
    held = torch.cat([log.heldout(0, r, 2).sparse_features["cat_0"].values() for r in (0, 1)])
    assert set(trained.tolist()) == set(range(236)) and held.tolist() == list(range(236, 300))
    with pytest.raises(ValueError, match="fewer than one global batch .* 4 held out for evaluation"):
        CriteoClickLog(load_config(tmp_path / "criteo.yaml"), [str(tsv)], tmp_path / "cache", 64, heldout_batches=4)
    # Synthetic: steps that training never reaches; its never-seen ids are never training's.
    log = SyntheticClickLog(load_config(QUICKSTART), 512, population=1000, new_id_fraction=0.5)
    held = log.heldout(1)
    halves = [log.heldout(1, r, 2) for r in (0, 1)]
    assert torch.equal(torch.cat([h.labels for h in halves]), held.labels)
    seen = set(torch.cat([log.batch(s).sparse_features["user_id"].values() for s in range(30)]).tolist())
    fresh = set(held.sparse_features["user_id"].values().tolist()) - seen
    assert len(fresh) > 200  # about half of 512 examples draw never-seen ids
