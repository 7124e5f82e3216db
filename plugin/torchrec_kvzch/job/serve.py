"""``torchrec-kvzch-serve``: the job's model served over HTTP on loopback, from its checkpoints,
following new ones as training writes them.

    torchrec-kvzch-serve --checkpoints runs/demo/checkpoints
    curl -s localhost:PORT/predict -d '{"examples": [{"dense": [0.1, ...13 values],
          "sparse": {"user_id": [42], "item_id": [7], "category": [3]}}]}'
    -> {"step": 400, "scores": [0.52]}
    curl -s localhost:PORT/status     # the step served, the newest one, the last error

The model is the job's DLRM of the config the run was trained with (the run directory's
``runs.jsonl`` records it; ``--config`` overrides), served by ``serving.Follower``: fp32 by
default, and ids without a row read what training's evaluation reads (their initial weights),
so its scores equal the trained model's. The server is the standard library's threaded HTTP
server: a loopback endpoint to try a model, not a production front end (no new dependency).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.job import config_path
from torchrec_kvzch.job.cli import UsageError
from torchrec_kvzch.job.data import DENSE_FEATURES
from torchrec_kvzch.job.model import dlrm
from torchrec_kvzch.job.report import read_jsonl
from torchrec_kvzch.serving import SERVED_DTYPES
from torchrec_kvzch.serving.build import DEFAULTS
from torchrec_kvzch.serving.follower import Follower
from torchrec_kvzch.serving.model import ServingOptions
from torchrec_kvzch.torchrec.config import ShardingConfig, load_config

PREFIX = "model.model"  # the job saves DLRMTrain's state dict under "model"; DLRM is its .model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrec-kvzch-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoints", required=True, help="the run's checkpoint directory (<run-dir>/checkpoints)")
    p.add_argument("--config", default=None,
                   help="the sharding config it was trained with (default: the one its run directory's runs.jsonl records)")
    p.add_argument("--port", type=int, default=8080, help="loopback port (0: any free one)")
    p.add_argument("--dtype", choices=list(SERVED_DTYPES), default="fp32", help="how every table is served")
    p.add_argument("--default", choices=list(DEFAULTS), default="initial",
                   help="what an id without a row reads (initial: as training's evaluation)")
    p.add_argument("--poll-s", type=float, default=1.0, help="seconds between looks for a new checkpoint")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model serves: cpu, or cuda (rows in GPU memory)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> Path:
    """Refuse a bad command line before anything is built; returns the checkpoint folder."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: use a port in [0, 65535] (0: any free one)")
    if not 0 < args.poll_s < math.inf:
        raise UsageError(f"--poll-s {args.poll_s}: use a positive, finite number of seconds")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here; use --device cpu")
    checkpoints = Path(args.checkpoints)
    if (checkpoints / "checkpoints").is_dir() or (checkpoints / "runs.jsonl").is_file():
        raise UsageError(f"--checkpoints {checkpoints} is a run folder; pass {checkpoints / 'checkpoints'}")
    if not CheckpointManager(checkpoints).steps():
        raise UsageError(f"--checkpoints: no checkpoints under {checkpoints}"
                         + ("" if checkpoints.is_dir() else " (no such folder)")
                         + "; pass the checkpoints folder of a run that has saved one (<run-dir>/checkpoints)")
    return checkpoints


def trained_config(checkpoints: Path, override: str | None) -> ShardingConfig:
    """The config of ``override``, else the one the run directory's last run recorded."""
    if override is not None:
        return load_config(config_path(override))
    runs = checkpoints.parent / "runs.jsonl"
    if not runs.is_file():
        raise UsageError(f"{runs} does not exist, so the config the model was trained with is unknown; pass --config")
    recorded = read_jsonl(runs)[-1]["config_yaml"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(recorded)
        f.flush()
        return load_config(f.name)


def to_batch(examples, features: list[str],
             tables: dict[str, tuple[str, int]] | None = None) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    """JSON examples -> (dense features ``[B, 13]``, the sparse features as a KJT); a bad
    example is refused naming it and the field. ``tables``: ``{feature: (table, num_embeddings)}``,
    so an id outside its table is named by example and feature here (the served table names
    only its position among the batch's ids)."""
    if not isinstance(examples, list) or not examples:
        raise ValueError('the body must be {"examples": [...]} with at least one example')
    dense, lengths, values = [], [[] for _ in features], [[] for _ in features]
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict) or set(ex) != {"dense", "sparse"}:
            raise ValueError(f"example {i}: expected the keys 'dense' and 'sparse'")
        if not (isinstance(ex["dense"], list) and len(ex["dense"]) == DENSE_FEATURES
                and all(isinstance(v, (int, float)) and math.isfinite(v) for v in ex["dense"])):
            raise ValueError(f"example {i}: 'dense' must be {DENSE_FEATURES} finite numbers (no NaN or "
                             "Infinity, nothing beyond a double's range)")
        sparse = ex["sparse"]
        unknown = sorted(set(sparse) - set(features)) if isinstance(sparse, dict) else None
        if unknown is None or unknown:
            raise ValueError(f"example {i}: 'sparse' has unknown features {unknown}; the model reads {features}"
                             if unknown else f"example {i}: 'sparse' must map features to lists of ids")
        dense.append(ex["dense"])
        for f, name in enumerate(features):
            ids = sparse.get(name, [])
            if not (isinstance(ids, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63
                                                   for v in ids)):
                raise ValueError(f"example {i}: feature '{name}' must be a list of non-negative integer ids")
            table, rows = (tables or {}).get(name, (None, 2**63))
            outside = next((v for v in ids if v >= rows), None)
            if outside is not None:
                raise ValueError(f"example {i}: feature '{name}': id {outside} is outside its table '{table}', "
                                 f"whose ids are [0, {rows}); check the feature's ids")
            lengths[f].append(len(ids))
            values[f].extend(ids)
    kjt = KeyedJaggedTensor(keys=features, values=torch.tensor([v for f in values for v in f], dtype=torch.long),
                            lengths=torch.tensor([n for f in lengths for n in f], dtype=torch.int32))
    return torch.tensor(dense, dtype=torch.float32), kjt


def handler(follower: Follower, features: list[str], tables: dict[str, tuple[str, int]], device: torch.device):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/status":
                return self._reply(200, follower.status())
            self._reply(404, {"error": f"no {self.path}; use POST /predict or GET /status"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/predict":
                return self._reply(404, {"error": f"no {self.path}; use POST /predict or GET /status"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
                dense, sparse = to_batch(body.get("examples") if isinstance(body, dict) else None, features, tables)
                torch.set_num_threads(1)  # (per thread: requests run side by side, one core each)
                with follower.serving() as version, torch.no_grad():  # one version for the whole request
                    scores = torch.sigmoid(version.model(dense.to(device), sparse.to(device)).squeeze(-1)).cpu()
                    step = version.step
            except (ValueError, json.JSONDecodeError) as e:
                return self._reply(400, {"error": str(e)})
            self._reply(200, {"step": step, "scores": scores.tolist()})

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # one line per request is noise here
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        checkpoints = check_args(args)
        config = trained_config(checkpoints, args.config)
    except ValueError as e:  # (a config's errors too) one line, as argparse's own, and no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = ServingOptions(dtype=args.dtype, default=args.default, kvzch={t.name: t for t in config.kvzch_tables},
                             device=args.device)
    try:
        follower = Follower(lambda: dlrm(config, torch.device("cpu")).model, checkpoints, prefix=PREFIX,
                            options=options, poll_s=args.poll_s).start()
    except (ValueError, FileNotFoundError) as e:  # a checkpoint that does not fit: it names file or table, and the fix
        print(f"error: {e}", file=sys.stderr)
        return 1
    features = [f for c in config.embedding_bag_configs() for f in c.feature_names]
    tables = {f: (t.name, t.num_embeddings) for t in config.tables for f in t.features}
    try:
        server = ThreadingHTTPServer(("127.0.0.1", args.port),
                                     handler(follower, features, tables, torch.device(args.device)))
    except OSError as e:
        follower.stop()
        print(f"error: --port {args.port}: cannot listen on 127.0.0.1 ({e.strerror}); use another port, or 0 for any "
              "free one", file=sys.stderr)
        return 2
    print(f"serving step {follower.current.step} of {checkpoints} on http://127.0.0.1:{server.server_port}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        follower.stop()
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
