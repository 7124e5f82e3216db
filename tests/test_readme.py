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
