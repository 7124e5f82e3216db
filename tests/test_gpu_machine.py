"""The GPU machines' offline kit and scripts (tools/gpu): setup.sh unpacks the repacked fbgemm-gpu
whether make_kit.sh wrote it as one archive or split it into parts; the larger-than-GPU run sizes
a table larger than the GPU memory it leaves itself, on either machine kind; the host-cache
bench's probe without its sync, and the report of that run."""

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools" / "gpu"), str(ROOT / "benchmarks")]
from bench_gpu import H100_BYTES, HOST_MARGIN, larger_plan, probes_unsynced  # noqa: E402
from pack_fbgemm import split  # noqa: E402
from report import host_table, larger_line, latest_tests, latest_table, touch_line  # noqa: E402
from torchrec_kvzch.table.id_map import IdMap  # noqa: E402


@pytest.mark.parametrize("part_mib", [60, 1])
def test_setup_unpacks_the_kit_in_one_archive_or_in_parts(tmp_path, part_mib):
    kit, site = tmp_path / "kit", tmp_path / "site"
    kit.mkdir()
    payload = os.urandom(5 << 19)  # 2.5 MiB that xz cannot shrink: three parts of 1 MiB
    archive = kit / "fb160.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name, data in (("kitprobe/__init__.py", b"VALUE = 42\n"), ("kitprobe/blob.bin", payload)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    split(str(archive), str(kit / "fb160"), part_mib)
    parts = sorted(p.name for p in kit.iterdir())
    assert parts == (["fb160.tar.xz"] if part_mib == 60 else ["fb160.part.00", "fb160.part.01", "fb160.part.02"])

    env = dict(os.environ, KVZCH_KIT=str(kit), KVZCH_SITE=str(site), PYTHON=sys.executable)
    script = '. tools/gpu/setup.sh && "$PYTHON" -c "import kitprobe; print(kitprobe.VALUE)"'
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "42"
    assert (site / "kitprobe" / "blob.bin").read_bytes() == payload


def test_setup_names_a_kit_without_the_archive(tmp_path):
    env = dict(os.environ, KVZCH_KIT=str(tmp_path), KVZCH_SITE=str(tmp_path / "site"), PYTHON=sys.executable)
    done = subprocess.run(["bash", "-c", ". tools/gpu/setup.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "make gpu-kit" in done.stderr and str(tmp_path) in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine where torch sees no GPU")
def test_the_cuda_tests_fail_on_a_gpu_machine_where_torch_sees_no_gpu():
    """Skipped on a machine without a GPU; with KVZCH_REQUIRE_CUDA=1 (a GPU machine) an error."""
    def pytest_run(**env):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"],
                              cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)

    skipped = pytest_run(KVZCH_REQUIRE_CUDA="0")
    assert skipped.returncode == 0 and "skipped" in skipped.stdout and "passed" not in skipped.stdout
    if not os.path.exists("/dev/nvidiactl"):
        refused = pytest_run(KVZCH_REQUIRE_CUDA="1")
        assert refused.returncode != 0 and "sees no CUDA device" in refused.stdout, refused.stdout


GIB = 2**30


@pytest.mark.parametrize("gpu, host, held_back", [(85e9, 120 * GIB, False),  # an H100 machine
                                                  (143.7e9, 123 * GIB, True),  # the H200 machine
                                                  (40e9, 400 * GIB, False)])
def test_the_larger_than_gpu_run_sizes_a_table_larger_than_the_gpu_memory_it_keeps(gpu, host, held_back):
    row_bytes = 512
    rows, held = larger_plan(int(gpu), host, row_bytes)
    table = rows * row_bytes
    assert (held > 0) == held_back
    assert table > 1.09 * (gpu - held)  # larger than what the GPU leaves the run
    assert table * HOST_MARGIN <= host  # and the host holds it with room to spare
    assert not held or table > H100_BYTES
    bench = {"larger_rows": rows, "dim": 128, "larger_host_bytes": table, "gpu_bytes": int(gpu),
             "larger_gpu_left_bytes": int(gpu) - held, "larger_gpu_ballast_bytes": held, "larger_step_ms": 12.0,
             "batch": 65536, "pooling": 20, "larger_build_s": 40.0, "larger_gpu_peak_bytes": 9 * GIB,
             "larger_gpu_used_bytes": 11 * GIB}
    line = larger_line({"date": "2026-11-27T00:00:00Z", "commit": "abc", "device": "GPU"}, bench)
    assert "1.10 times" in line and ("held" in line) == held_back


def test_the_larger_than_gpu_run_refuses_a_host_without_room():
    with pytest.raises(SystemExit, match="80 GB"):
        larger_plan(int(143.7e9), 64 * GIB, 512)


def test_a_gpu_runs_tests_renew_their_own_groups_and_name_the_gpu(tmp_path):
    """report.py: a run's JUnit files replace those groups' latest results (with the GPU its log
    names), other groups keep theirs; a rehearsal's log names the CPU."""
    log = ("== GPU check 2026-12-01T00:00:00Z, abc1234\nname, memory.total [MiB], driver_version\n"
           "NVIDIA H100 80GB HBM3, 81559 MiB, 570.1\n")
    (tmp_path / "gpu.log").write_text(log)
    (tmp_path / "kernel.xml").write_text('<testsuites><testsuite tests="41" failures="1" errors="0" skipped="2"/>'
                                         "</testsuites>")
    old = {"kernel": {"tests": 34, "failures": 0, "errors": 0, "skipped": 0, "date": "d0", "commit": "c0", "device": "x"},
           "serving": {"tests": 12, "failures": 0, "errors": 0, "skipped": 0, "date": "d0", "commit": "c0", "device": "x"}}
    latest = latest_tests(old, tmp_path)
    assert latest["serving"] == old["serving"]
    assert latest["kernel"] == {"tests": 41, "failures": 1, "errors": 0, "skipped": 2, "date": "2026-12-01T00:00:00Z",
                                "commit": "abc1234", "device": "NVIDIA H100 80GB HBM3"}
    assert "| kernel | 38 of 41 | 1 | 2026-12-01T00:00:00Z, abc1234, NVIDIA H100 80GB HBM3 |" in latest_table(latest)
    (tmp_path / "gpu.log").write_text("== GPU check 2026-12-01T00:00:00Z, abc1234\n")
    assert latest_tests({}, tmp_path)["kernel"]["device"] == "the CPU (a rehearsal)"
    bench = {"device": "NVIDIA H200", "rows": 10, "occurrences": 20, "distinct_uniform": 9, "distinct_zipf": 4,
             **{f"touch_ms_{n}_{d}": i / 10 for i, (n, d) in enumerate(
                 (n, d) for n in ("sorted", "relaxed", "fenced") for d in ("uniform", "zipf"))}}
    line = touch_line(tmp_path, bench)
    assert "(sorted) 0.000 / 0.100" in line and "0.200 / 0.300" in line and "0.400 / 0.500" in line


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_unsynced_probe_finds_known_ids_and_voids_a_batch_with_new_ones():
    """bench_gpu's probe without its host sync (the kernels under Triton's interpreter here):
    batches of known ids get their slots as with the sync; a batch with a new id voids the run."""
    m = IdMap("triton", "cuda" if torch.cuda.is_available() else "cpu")
    known = torch.arange(100, 1100, 7, device=m.device)
    want = m.find_or_insert(known)
    with probes_unsynced():
        assert torch.equal(m.find_or_insert(known.flip(0)), want.flip(0))
        assert torch.equal(m.find(known[:5]), want[:5])
    with pytest.raises(SystemExit, match="new or bad ids"), probes_unsynced():
        m.find_or_insert(torch.tensor([100, 5], device=m.device))


def test_the_host_table_gives_the_unsynced_step_its_line():
    """report.py renders the host-cache run of record, and the step without the probe's sync where
    the run has it."""
    docs = ROOT / "docs" / "benchmarks"
    record, bench = (json.loads((docs / name).read_text()) for name in ("gpu_host_run.json", "gpu_host.json"))
    bench = {k: v for k, v in bench.items() if "unsynced" not in k}
    assert "probe left unread" not in host_table(record, bench)
    bench.update(unsynced_ms_host_50_zipf=3.25, ratio_unsynced_host_50_zipf=0.52)
    assert "probe left unread by the host (batches of known ids only): 3.25 ms, ratio 0.520" in host_table(record, bench)
