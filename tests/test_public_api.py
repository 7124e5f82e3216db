"""What ``torchrec_kvzch`` exports, and the old import paths of 0.1, which keep working for one
release with a DeprecationWarning (docs/design.md, "Changes in 0.2")."""

import importlib
import subprocess
import sys
import warnings

import pytest

import torchrec_kvzch


def test_everything_exported_exists_and_nothing_private_is():
    assert all(hasattr(torchrec_kvzch, name) for name in torchrec_kvzch.__all__)
    assert not [name for name in torchrec_kvzch.__all__ if name.startswith("_")]
    # one object per concept, whichever path reaches it
    from torchrec_kvzch.checkpoint.load_planner import KVZCHLoadPlanner
    from torchrec_kvzch.table.tbe import TableTBE
    from torchrec_kvzch.torchrec.modules import kvzch_sharders
    assert (torchrec_kvzch.KVZCHLoadPlanner, torchrec_kvzch.TableTBE, torchrec_kvzch.kvzch_sharders) == (
        KVZCHLoadPlanner, TableTBE, kvzch_sharders)


@pytest.mark.parametrize("old, new, name", [
    ("torchrec_kvzch.sharding", "torchrec_kvzch.torchrec", "kvzch_sharders"),
    ("torchrec_kvzch.config", "torchrec_kvzch.torchrec.config", "load_config"),
    ("torchrec_kvzch.train", "torchrec_kvzch.job.train", "main"),
])
def test_old_module_paths_warn_and_alias_the_new_ones(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_old_planner_path_warns_for_the_planners_only():
    from torchrec_kvzch.checkpoint import planner
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the record classes (old checkpoints unpickle them): silent
        assert planner.CheckpointMappings is importlib.import_module("torchrec_kvzch.checkpoint.record").CheckpointMappings
    with pytest.warns(DeprecationWarning, match="checkpoint.planner.KVZCHSavePlanner is deprecated"):
        from torchrec_kvzch.checkpoint.planner import KVZCHSavePlanner
    assert KVZCHSavePlanner is torchrec_kvzch.KVZCHSavePlanner


def test_the_old_job_entry_point_still_runs():
    run = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "torchrec_kvzch.train",
                          "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--config" in run.stdout
    assert "torchrec_kvzch.train is deprecated" in run.stderr
    # ... and exits with the job's status: 2 for a refused command line, as the new path does
    refused = subprocess.run([sys.executable, "-m", "torchrec_kvzch.train", "--nproc", "0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "error: --nproc 0" in refused.stderr


def test_the_version_is_the_installed_one_and_the_changelog_names_it():
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path
    try:
        installed = version("torchrec-kvzch")
    except PackageNotFoundError:
        pytest.skip("torchrec-kvzch is not installed as a package here")
    assert torchrec_kvzch.__version__ == installed
    changelog = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    assert f"## {installed}" in changelog


def test_every_package_the_plugin_imports_is_declared():
    """A wheel installed elsewhere brings what the package imports: each third-party module
    it imports is in setup.cfg's install_requires or an extra, but for those setup.cfg says
    come apart (torchrec, installed with --no-deps) or with the GPU stack (triton)."""
    import ast
    import configparser
    from pathlib import Path

    root = Path(torchrec_kvzch.__file__).parent
    imported = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported - set(sys.stdlib_module_names) if m != "torchrec_kvzch"}
    cfg = configparser.ConfigParser()
    cfg.read(root.parent.parent / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines() + [
        line for extra in cfg["options.extras_require"].values() for line in extra.splitlines()]
    declared = {line.split(">")[0].split("=")[0].split("<")[0].strip().lower() for line in lines
                if line.strip() and not line.strip().startswith("#")}
    distribution = {"yaml": "pyyaml", "fbgemm_gpu": "fbgemm-gpu"}
    apart = {"torchrec", "triton"}
    missing = sorted(m for m in third_party - apart if distribution.get(m, m) not in declared)
    assert not missing, f"imported but not declared in setup.cfg: {missing}"
