"""Sharding configs: the shipped ones load and plan; bad ones fail naming file, key and fix."""


import pytest
import torch
from torchrec.distributed.planner import Topology
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_kvzch.torchrec.config import ConfigError, load_config
from torchrec_kvzch.torchrec import KVZCH_KERNEL, KVZCHParameterSharding

from torchrec_kvzch.job import SHIPPED_CONFIGS as CONFIGS, config_path


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load_and_plan(name):
    config = load_config(CONFIGS / name)
    model = EmbeddingBagCollection(tables=config.embedding_bag_configs(), device=torch.device("meta"))
    planner = config.planner(Topology(world_size=2, compute_device="cpu", local_world_size=2), batch_size=1024)
    plan = planner.plan(model, config.sharders()).plan[""]
    for table in config.tables:
        is_kv = table.kvzch is not None
        assert isinstance(plan[table.name], KVZCHParameterSharding) == is_kv
        assert (plan[table.name].compute_kernel == KVZCH_KERNEL) == is_kv


def test_the_shipped_configs_are_the_top_level_ones_and_an_installed_package_carries_them(tmp_path):
    """In a checkout they are read from the top-level ``configs/``; the package build copies
    them into ``torchrec_kvzch/configs`` (setup.py's package data), where an installed
    package finds them by name."""
    import subprocess
    import sys
    from pathlib import Path

    import torchrec_kvzch

    root = Path(__file__).resolve().parents[1]
    shipped = sorted(p.name for p in (root / "configs").glob("*.yaml"))
    assert {"quickstart.yaml", "criteo.yaml"} <= set(shipped)
    if Path(torchrec_kvzch.__file__).is_relative_to(root / "plugin"):  # (a checkout, or an editable install)
        assert CONFIGS == root / "configs"
    else:  # an installed copy (as ``make test-compat`` runs the suite): its own, the same files
        assert CONFIGS == Path(torchrec_kvzch.__file__).parent / "configs"
        assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == shipped
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=root,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    packaged = tmp_path / "torchrec_kvzch" / "configs"
    assert sorted(p.name for p in packaged.glob("*.yaml")) == sorted(p.name for p in CONFIGS.glob("*.yaml"))
    found = subprocess.run([sys.executable, "-c", "from torchrec_kvzch.job import config_path; "
                            "print(config_path('quickstart'))"], capture_output=True, text=True, timeout=120,
                           env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert found.returncode == 0, found.stderr[-3000:]
    assert Path(found.stdout.strip()) == packaged / "quickstart.yaml"


def test_a_shipped_configs_name_mistyped_gets_the_close_ones_and_every_list_is_the_folders(capsys):
    """Names come from configs/*.yaml alone: the error, --help and docs/job.md list them all."""
    import re
    from pathlib import Path

    from torchrec_kvzch.job import shipped_config_names
    from torchrec_kvzch.job.cli import parse_args
    from torchrec_kvzch.job.train import main

    names = shipped_config_names()
    assert names == sorted(p.stem for p in CONFIGS.glob("*.yaml")) and {"quickstart", "disk"} <= set(names)
    assert main(["--config", "quickstrat", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: quickstrat: no such sharding config; did you mean 'quickstart'? shipped: {', '.join(names)}; or "
        "give the path of a YAML file"]
    with pytest.raises(ConfigError, match=f"^xyzzy: no such sharding config; shipped: {', '.join(names)}; or give"):
        config_path("xyzzy")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert f"({', '.join(names)})" in " ".join(capsys.readouterr().out.split())
    job_md = (Path(__file__).resolve().parents[1] / "docs" / "job.md").read_text()
    listed = job_md[job_md.index("### Shipped configs"):job_md.index("## Data")]
    assert re.findall(r"^- `(\w+)`:", listed, re.M) == names


def test_quickstart_declares_two_kvzch_tables_and_one_ordinary():
    config = load_config(CONFIGS / "quickstart.yaml")
    assert [t.name for t in config.kvzch_tables] == ["user", "item"]
    user = config.kvzch_tables[0]
    assert user.num_embeddings == 2**40 and user.backend_return_whole_row and user.learning_rate == 0.05
    assert config.constraints()["category"].sharding_types == ["row_wise"]


GOOD_TABLE = "  - name: t\n    embedding_dim: 8\n    features: [f]\n"


@pytest.mark.parametrize("text, fragment", [
    ("tables: []\n", "tables: expected a non-empty list of tables"),
    ("optimiser: {}\ntables:\n" + GOOD_TABLE + "    num_embeddings: 10\n",
     "optimiser: unknown key; did you mean 'optimizer'? allowed: description, optimizer, rank_budget, table_defaults, tables"),
    ("optimizer: {type: lamb}\ntables:\n" + GOOD_TABLE + "    num_embeddings: 10\n",
     "optimizer.type: 'lamb' is not supported (upstream's KV-ZCH tables train with these alone); use one of exact_rowwise_adagrad, exact_sgd, adam, partial_rowwise_adam"),
    ("tables:\n" + GOOD_TABLE, "tables[0] (t): missing required key 'num_embeddings' (or a 'kvzch' block)"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n    pooling: max\n",
     "tables[0] (t).pooling: 'max' is not allowed; use one of sum, mean"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: ten\n",
     "tables[0] (t).num_embeddings: expected an integer (or 'a^b'), got 'ten'"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n    colour: red\n",
     "tables[0] (t).colour: unknown key; allowed: embedding_dim, features, kvzch, name, num_embeddings, planner, pooling"),
    ("tables:\n" + GOOD_TABLE + "    kvzch: {num_embeddings: 2^20, total_num_buckets: 16, backend_return_whole_row: true}\n",
     "tables[0] (t).kvzch: KV-ZCH table 't': backend_return_whole_row is only valid with enable_optimizer_offloading"),
    ("tables:\n" + GOOD_TABLE + "    kvzch: {num_embeddings: 2^20, total_num_buckets: 16, bucket_count: 3}\n",
     "tables[0] (t).kvzch.bucket_count: unknown key; allowed: admission, backend_return_whole_row, beta1, beta2, checkpoint_chunk_rows"),
    ("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, eviction: {kind: lru, rows: 5}}\n",
     "tables[0] (t).kvzch.eviction.rows: unknown key; did you mean 'max_rows'? allowed: count_decay, count_threshold, decay_interval_minutes, default_feature_score, feature_scores, free_memory_bytes, interval_steps, keep_rows, kind, l2_threshold, max_bytes, max_rows, score_bucket_width, score_buckets, table_max_bytes, table_max_rows, trigger, trigger_bytes, trigger_rows, ttl_minutes, ttl_steps"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n    planner: {sharding_types: [diagonal]}\n",
     "tables[0] (t).planner.sharding_types[0]: 'diagonal' is not allowed; use one of data_parallel"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n" + GOOD_TABLE + "    num_embeddings: 10\n",
     "tables (t): duplicate table name"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n  - {name: u, embedding_dim: 4, features: [f], num_embeddings: 3}\n",
     "tables (u).features: feature 'f' already feeds table 't'"),
    ("tables: [\n", "not valid YAML"),
    ("rank_budget: {max_bytes: 2^20, order: fifo}\ntables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16}\n",
     "rank_budget: order 'fifo' is unknown; use lru or lfu"),
    ("rank_budget: {}\ntables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16}\n",
     "rank_budget: set max_rows and/or max_bytes"),
    ("rank_budget: {max_rows: many}\ntables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16}\n",
     "rank_budget.max_rows: expected an integer (or 'a^b'), got 'many'"),
    ("rank_budget: {bytes: 5}\ntables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16}\n",
     "rank_budget.bytes: unknown key; did you mean 'max_bytes'? allowed: max_bytes, max_rows, order"),
    ("rank_budget: {max_rows: 5}\ntables:\n" + GOOD_TABLE + "    num_embeddings: 10\n",
     "rank_budget: no table is KV-ZCH (has a 'kvzch' block); remove rank_budget"),
    ("table_defaults: {colour: red}\ntables:\n" + GOOD_TABLE + "    num_embeddings: 10\n",
     "table_defaults.colour: unknown key"),
    ("table_defaults: {kvzch: {total_num_buckets: 16}}\ntables:\n" + GOOD_TABLE + "    num_embeddings: 10\n",
     "tables[0] (t).num_embeddings: a KV-ZCH table sets num_embeddings inside 'kvzch' (for an ordinary "
     "table under a table_defaults kvzch block, set kvzch: false)"),
    ("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, expected_rows: many}\n",
     "tables[0] (t).kvzch.expected_rows: expected an integer (or 'a^b'), got 'many'"),
    ("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, eviction: {kind: lur, max_rows: 9}}\n",
     "eviction.kind 'lur' is unknown; did you mean 'lru'? use one of none, ttl"),
    ("tables:\n" + GOOD_TABLE + "    pooling: summ\n    num_embeddings: 10\n",
     "tables[0] (t).pooling: 'summ' is not allowed; did you mean 'sum'? use one of sum, mean"),
    ("optimizer: {type: adam}\ntables:\n" + GOOD_TABLE + "    num_embeddings: 10\n",
     "optimizer.type: adam would also train the ordinary tables ['t'], which fbgemm's CPU TBE cannot"),
    ("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, optimizer: lamb}\n",
     "tables[0] (t).kvzch.optimizer: 'lamb' is not supported (upstream's KV-ZCH tables train with these alone)"),
    ("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, optimizer: adam, beta1: 1.5}\n",
     "tables[0] (t).kvzch: KV-ZCH table 't': beta1 must be a number in [0, 1)"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 0\n",
     "tables[0] (t).num_embeddings: expected a positive integer, got 0"),
    ("tables:\n" + GOOD_TABLE.replace("8", "0") + "    num_embeddings: 10\n",
     "tables[0] (t).embedding_dim: expected a positive integer, got 0"),
    ("tables:\n" + GOOD_TABLE.replace("name: t", "name: 123") + "    num_embeddings: 10\n",
     "tables[0] (123).name: expected a non-empty string (quote one YAML reads otherwise), got 123"),
    ("tables:\n" + GOOD_TABLE.replace("name: t", "name: ''") + "    num_embeddings: 10\n",
     "tables[0] ().name: expected a non-empty string"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n    planner: {compute_kernels: [bogus]}\n",
     "tables[0] (t).planner.compute_kernels[0]: 'bogus' is not allowed; use one of dense, fused"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n    planner: {pooling_factors: 3}\n",
     "tables[0] (t).planner.pooling_factors: expected a list, got 3; write [3]"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n    planner: {pooling_factors: [0]}\n",
     "tables[0] (t).planner.pooling_factors[0]: expected a positive number, got 0"),
    ("tables:\n" + GOOD_TABLE + "    num_embeddings: 10\n    planner: {sharding_types: row_wise}\n",
     "tables[0] (t).planner.sharding_types: expected a list, got 'row_wise'; write [row_wise]"),
    ("tables:\n" + GOOD_TABLE.replace("8", "30") + "    kvzch: {total_num_buckets: 16}\n",
     "tables[0] (t).embedding_dim: 30 is not a multiple of 4, which fbgemm's TBE kernels need"),
    ("tables:\n" + GOOD_TABLE.replace("8", "6") + "    num_embeddings: 10\n    planner: {sharding_types: [row_wise]}\n",
     "tables[0] (t).embedding_dim: 6 is not a multiple of 4, which fbgemm's TBE kernels need (KV-ZCH tables', and "
     "TorchRec's for every table not sharded data_parallel alone); use 8, the next multiple"),
    ("tables:\n" + GOOD_TABLE.replace("name: t", "name: keys") + "    num_embeddings: 10\n",
     "tables[0] (keys).name: 'keys' is already an attribute of nn.ModuleDict; rename the table (TorchRec keeps a "
     "collection's tables in an nn.ModuleDict, keyed by name)"),
    ("tables:\n" + GOOD_TABLE.replace("name: t", "name: training") + "    kvzch: {total_num_buckets: 16}\n",
     "tables[0] (training).name: 'training' is already an attribute of nn.ModuleDict; rename the table"),
    ("tables:\n" + GOOD_TABLE.replace("name: t", "name: user.v2") + "    num_embeddings: 10\n",
     "tables[0] (user.v2).name: 'user.v2' contains '.', which a module's name may not; rename the table"),
])
def test_bad_configs_name_file_key_and_fix(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ")
    assert fragment in str(err.value)


def test_an_ordinary_table_sharded_data_parallel_alone_may_have_any_dim(tmp_path):
    """TorchRec's data-parallel tables do not go through fbgemm's TBE, which needs a multiple of 4."""
    path = tmp_path / "dp.yaml"
    path.write_text("tables:\n" + GOOD_TABLE.replace("8", "6") + "    num_embeddings: 10\n"
                    "    planner: {sharding_types: [data_parallel]}\n")
    assert load_config(path).tables[0].embedding_dim == 6


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such sharding config"):
        load_config(tmp_path / "nope.yaml")


def test_table_defaults_fill_every_table_and_kvzch_false_makes_an_ordinary_one(tmp_path):
    path = tmp_path / "defaults.yaml"
    path.write_text(
        "table_defaults:\n"
        "  embedding_dim: 16\n"
        "  kvzch: {num_embeddings: 2^20, total_num_buckets: 16, expected_rows: 100,\n"
        "          eviction: {kind: lru, max_rows: 2^10}}\n"
        "tables:\n"
        "  - {name: a, features: [fa]}\n"
        "  - {name: b, features: [fb], embedding_dim: 8, kvzch: {expected_rows: 7, init_range: [-0.5, 0.5]}}\n"
        "  - {name: c, features: [fc], num_embeddings: 10, kvzch: false}\n")
    a, b, c = load_config(path).tables
    assert (a.embedding_dim, a.kvzch.expected_rows, a.kvzch.num_embeddings) == (16, 100, 2**20)
    assert a.kvzch.eviction.max_rows == 1024  # integer fields take a^b, as the dataclass types say
    assert (b.embedding_dim, b.kvzch.expected_rows, b.kvzch.total_num_buckets) == (8, 7, 16)
    assert b.kvzch.init_range == (-0.5, 0.5)  # tuple fields take YAML lists
    assert c.kvzch is None and (c.embedding_dim, c.num_embeddings) == (16, 10)


def test_a_kvzch_block_sets_adam_and_its_betas(tmp_path):
    path = tmp_path / "adam.yaml"
    path.write_text("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, optimizer: adam, beta1: 0.8, "
                    "weight_decay: 0.01, weight_decay_mode: decouple}\n")
    kv = load_config(path).tables[0].kvzch
    assert (kv.optimizer.value, kv.beta1, kv.beta2, kv.weight_decay) == ("adam", 0.8, 0.999, 0.01)


def test_a_kvzch_block_sets_a_device_cache_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, device_cache: {load_factor: 0.25, "
                    "policy: lfu}}\n")
    cache = load_config(path).tables[0].kvzch.device_cache
    assert (cache.load_factor, cache.policy.value, cache.enabled) == (0.25, "lfu", True)
    path.write_text("tables:\n" + GOOD_TABLE + "    kvzch: {total_num_buckets: 16, device_cache: {load_factor: 2}}\n")
    with pytest.raises(ConfigError, match=r"device_cache load_factor must be a number in \(0, 1\]"):
        load_config(path)
