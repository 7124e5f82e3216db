"""The README's Python examples run as written, in order, in one fresh interpreter."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 5
    checks = ("\nassert item.bucket_range(1, 3).start == 342"
              "\nassert slots.tolist() == [0, 1, 0]"
              "\nassert out.shape == (2, 64)"
              "\nfrom torchrec_kvzch.sharding import kvzch_tables"
              "\nassert {n: len(k.store) for n, k in kvzch_tables(model)} == {'user': 2}"
              "\nprint('readme ok')\n")
    # A subprocess: the DMP example initialises (and destroys) a process group.
    run = subprocess.run([sys.executable, "-c", "\n".join(blocks) + checks], cwd=README.parent,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "readme ok" in run.stdout


def test_porting_guide_example_runs():
    guide = README.parent / "docs" / "porting.md"
    [block] = re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)
    checks = ("\nfrom torchrec_kvzch.sharding import kvzch_tables"
              "\n[(name, kernel)] = kvzch_tables(model)"
              "\nassert name == 'user' and len(kernel.store) == 2"
              "\nassert kernel.params.eviction.ttl_minutes == 24 * 60"
              "\nassert kernel.params.optimizer.value == 'exact_row_wise_adagrad'"
              # the warm-up's rate reached fbgemm: 0.05 x (0.1 + 0.9 x 2 / 100) in the third step
              "\nassert abs(kernel.tbe.get_learning_rate() - 0.05 * (0.1 + 0.9 * 2 / 100)) < 1e-6"
              "\nprint('guide ok')\n")
    run = subprocess.run([sys.executable, "-c", block + checks], cwd=README.parent,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "guide ok" in run.stdout
