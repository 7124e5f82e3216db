"""``torchrec-kvzch-serve`` (issue 31): the job's model served over HTTP from its checkpoints
scores the fixed batch as the trained model did, follows a delta saved while it runs, and
refuses bad requests naming the example and field."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_train import QUICKSTART, train
from torchrec_kvzch.job.data import SyntheticClickLog
from torchrec_kvzch.torchrec.config import load_config


def fixed_batch():
    """test_train's data (SMALL's global batch and population): the job's ``data.probe()``."""
    batch = SyntheticClickLog(load_config(QUICKSTART), 256, 0, 3000, 1.05, 0.02).probe()
    ids = {f: jt.values().tolist() for f, jt in batch.sparse_features.to_dict().items()}
    return [{"dense": dense, "sparse": {f: [v[i]] for f, v in ids.items()}}
            for i, dense in enumerate(batch.dense_features.tolist())]


def request(url, payload=None):
    data = None if payload is None else json.dumps(payload).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data), timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A trained run (deltas between full checkpoints) and the server over its checkpoints,
    shared by this module's tests (the first one trains it on: the others take either step)."""
    run = tmp_path_factory.mktemp("serve") / "run"
    flags = ["--checkpoint-every", 4, "--incremental-every", 2]
    _, first = train(run, "--steps", 6, *flags)
    script = Path(sys.executable).parent / "torchrec-kvzch-serve"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "torchrec_kvzch.job.serve"]
    proc = subprocess.Popen(cmd + ["--checkpoints", str(run / "checkpoints"), "--port", "0", "--poll-s", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "http://127.0.0.1:" in line, proc.stderr.read()[-3000:]
    yield run, flags, first, line.split()[-1]
    proc.terminate()
    proc.wait(timeout=30)


def test_the_server_scores_as_the_trained_model_and_follows_a_new_delta(server):
    run, flags, first, url = server
    examples = fixed_batch()
    code, reply = request(url + "/predict", {"examples": examples})
    assert code == 200 and reply["step"] == 6 and reply["scores"] == first["probe_final"]
    _, second = train(run, "--steps", 8, *flags, nproc=1, summary="second.json")
    assert second["checkpoint_chain"][-1] == 8  # (a delta: the follower applies it to the version served)
    deadline = time.monotonic() + 60
    while request(url + "/status")[1]["step"] != 8:
        assert time.monotonic() < deadline, request(url + "/status")[1]
        time.sleep(0.2)
    code, reply = request(url + "/predict", {"examples": examples})
    assert code == 200 and reply["step"] == 8 and reply["scores"] == second["probe_final"]
    assert request(url + "/status")[1]["last_error"] is None


def test_bad_requests_name_the_example_and_field(server):
    _, _, _, url = server
    good = fixed_batch()[0]
    cases = [
        ({"examples": [good, {**good, "sparse": {"user_idd": [1]}}]}, "example 1: 'sparse' has unknown features ['user_idd']"),
        ({"examples": [{**good, "dense": [1.0]}]}, "example 0: 'dense' must be 13 finite numbers"),
        ({"examples": [{**good, "sparse": {"user_id": [-3]}}]}, "example 0: feature 'user_id' must be a list of non-negative"),
        ({"examples": []}, 'the body must be {"examples": [...]}'),
        ({"examples": [good, {**good, "sparse": {"category": [3, 5000]}}]},
         "example 1: feature 'category': id 5000 is outside its table 'category', whose ids are [0, "),
        ({"examples": [{**good, "dense": [float("nan")] + good["dense"][1:]}]}, "example 0: 'dense' must be 13 finite numbers"),
        ({"examples": [good, {**good, "dense": good["dense"][:-1] + [float("inf")]}]}, "example 1: 'dense' must be 13 finite"),
    ]
    for payload, message in cases:
        code, reply = request(url + "/predict", payload)
        assert code == 400 and message in reply["error"], (payload, reply)
    assert request(url + "/nowhere")[0] == 404


def test_the_jobs_served_dlrm_exports_and_predicts_the_same(server):
    """The job's DLRM (dense and sparse) served from its run and exported: the program, taking
    plain tensors, scores the fixed batch as the eager served model does."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch.job.model import dlrm
    from torchrec_kvzch.job.serve import PREFIX, to_batch
    from torchrec_kvzch.serving import ServingOptions, export_served, served_model

    run, _, _, _ = server
    config = load_config(QUICKSTART)
    options = ServingOptions(default="initial", kvzch={t.name: t for t in config.kvzch_tables})
    model, step = served_model(dlrm(config, torch.device("cpu")).model, run / "checkpoints", prefix=PREFIX,
                               options=options)
    features = [f for c in config.embedding_bag_configs() for f in c.feature_names]
    dense, sparse = to_batch(fixed_batch(), features)
    with torch.no_grad():
        want = model(dense, sparse)
    program = export_served(model, (dense, sparse)).module()
    assert step in (6, 8) and torch.equal(program(dense, sparse.values(), sparse.lengths()), want)
    b = dense.shape[0]  # a batch of one (the KJT's values are feature by feature: 0, b, 2b)
    one = KeyedJaggedTensor(keys=features, values=sparse.values()[torch.tensor([0, b, 2 * b])],
                            lengths=torch.ones(3, dtype=torch.int32))
    with torch.no_grad():
        want_one = model(dense[:1], one)
    assert torch.equal(program(dense[:1], one.values(), one.lengths()), want_one)


def test_a_bad_command_line_is_one_line_naming_the_fix(server, tmp_path, capsys, monkeypatch):
    """Exit status 2 and one line, before anything is built; a wrong --checkpoints said that the
    config was unknown, the others were tracebacks, and --poll-s 0 polled in a busy loop."""
    import torch

    from torchrec_kvzch.job.serve import main
    run = server[0]
    good = ["--checkpoints", str(run / "checkpoints")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [
        (["--checkpoints", str(tmp_path / "nosuch")], f"--checkpoints: no checkpoints under {tmp_path / 'nosuch'} "
         "(no such folder); pass the checkpoints folder of a run that has saved one (<run-dir>/checkpoints)"),
        (["--checkpoints", str(tmp_path)], f"--checkpoints: no checkpoints under {tmp_path}; pass the checkpoints "
         "folder of a run that has saved one (<run-dir>/checkpoints)"),
        (["--checkpoints", str(run)], f"--checkpoints {run} is a run folder; pass {run / 'checkpoints'}"),
        ([*good, "--config", "quickstrat"], "quickstrat: no such sharding config"),
        ([*good, "--device", "cuda"], "--device cuda: torch sees no CUDA device here; use --device cpu"),
        ([*good, "--port", "-1"], "--port -1: use a port in [0, 65535] (0: any free one)"),
        ([*good, "--poll-s", "0"], "--poll-s 0.0: use a positive, finite number of seconds"),
        ([*good, "--poll-s", "nan"], "--poll-s nan: use a positive, finite number of seconds"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {message}"), argv
    with socket.socket() as busy:  # (a port in use: found once the model is built)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main([*good, "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --port {port}: cannot listen on 127.0.0.1 (Address already in use); use another port, or 0 for "
        "any free one")


def test_a_follower_refuses_to_poll_in_a_busy_loop(tmp_path):
    from torchrec_kvzch.serving.follower import Follower
    for poll_s in (0, -1, float("nan")):
        with pytest.raises(ValueError, match=f"poll_s={poll_s}; poll every positive, finite number of seconds"):
            Follower(lambda: pytest.fail("built before the check"), tmp_path, poll_s=poll_s)
