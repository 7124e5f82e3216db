"""The docs run as written: every ```python block of README.md and of each docs/*.md page runs,
in order, in one fresh interpreter per page (cwd = the repository root), followed by the checks
below. Blocks that cannot run on a CPU in CI are ```bash or ```text. Also: the README stays
short, relative links point at files and headings that exist, YAML configs in the docs load,
and the benchmark table lives in exactly one place (docs/benchmarks.md, which
benchmarks/run_all.py rewrites between its markers)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("<!-- bench:table:start -->", "<!-- bench:table:end -->")


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


# Appended to a page's blocks: what the examples claim in their comments.
CHECKS = {
    "README.md": """
assert out.shape == (2, 64)
assert checkpoints.steps() == [1]
from torchrec_kvzch import kvzch_tables
assert {n: len(k.store) for n, k in kvzch_tables(model)} == {'user': 2}
""",
    "docs/torchrec.md": """
assert item.bucket_range(1, 3).start == 342
assert [(t.name, t.kvzch is not None) for t in config.tables] == [('user', True), ('item', True), ('category', False)]
assert config.tables[0].kvzch.total_num_buckets == 64 and config.tables[0].kvzch.expected_rows == 200000
assert {n: len(k.store) for n, k in kvzch_tables(model)} == {'user': 2, 'item': 2}
assert 'has id -5' in message
""",
    "docs/serving.md": """
assert step == 2 and same and 0 < int8_error < 0.01
assert torch.equal(exported, trained) and follower.current.step == 2 and not follower.poll()
with follower.serving() as version:
    assert torch.equal(version.model(probe).values(), trained)
""",
    "docs/design.md": """
assert slots.tolist() == [0, 1, 0]
assert rows.shape == (2, 136)
assert torch.sort(store.keys()).values.tolist() == [3, 5, 2**39]
assert momentum.read_only and not torch.equal(weights.full_tensor(), at_freeze)
assert pooled.shape == (2, 128) and tbe.store.counters['rows'] == 3
""",
    "docs/checkpoints.md": """
assert same and resumed_same and chain_same
assert manager.steps() == [2, 3]
assert incremental.steps() == [5, 6] and incremental.chain(6) == [5, 6]
""",
    "docs/admission.md": """
assert tbe.store.counters['rows'] == 2 and tbe.store.counters['admitted'] == 2
assert tbe.store.counters['rejected'] == 1 and sorted(tbe.store.keys().tolist()) == [7, 8]
assert second.abs().sum() > 0  # 7 reads its new row now
""",
    "docs/eviction.md": """
assert tbe.store.counters['rows'] <= 1000 and tbe.store.counters['inserted'] == 3000
assert tbe.store.find(torch.tensor([0, 2999])).tolist()[0] == -1
assert 1500 < budget.usage()['rows'] <= 1500 + 1000
""",
    "docs/porting.md": """
from torchrec_kvzch.torchrec import kvzch_tables
[(name, kernel)] = kvzch_tables(model)
assert name == 'user' and len(kernel.store) == 2
assert kernel.params.eviction.ttl_minutes == 24 * 60
assert kernel.params.optimizer.value == 'exact_row_wise_adagrad'
# the warm-up's rate reached fbgemm: 0.05 x (0.1 + 0.9 x 2 / 100) in the third step
assert abs(kernel.tbe.get_learning_rate() - 0.05 * (0.1 + 0.9 * 2 / 100)) < 1e-6
""",
}


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


RUNNABLE = [p for p in PAGES if blocks(p, "python")]


def test_every_checked_page_has_python_blocks():
    assert set(CHECKS) <= {name(p) for p in RUNNABLE}


@pytest.mark.parametrize("page", RUNNABLE, ids=name)
def test_python_blocks_run(page):
    # A subprocess per page: the examples initialise (and destroy) process groups.
    code = "\n".join(blocks(page, "python")) + CHECKS.get(name(page), "") + "\nprint('page ok')\n"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "page ok" in run.stdout


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{name(page)}: link to {target}: no such file"
        if fragment:
            headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", linked.read_text(),
                                                        flags=re.S | re.M), flags=re.M)
            assert fragment in {anchor(h) for h in headings}, f"{name(page)}: link to {target}: no such heading"


def test_yaml_configs_in_the_docs_load(tmp_path):
    from torchrec_kvzch import load_config

    configs = [b for p in PAGES for b in blocks(p, "yaml") if "tables" in (yaml.safe_load(b) or {})]
    assert configs
    for i, block in enumerate(configs):
        path = tmp_path / f"{i}.yaml"
        path.write_text(block)
        load_config(path)


def test_the_benchmark_table_lives_in_docs_benchmarks_md():
    for page in PAGES:
        count = page.read_text().count(MARKERS[0]) + page.read_text().count(MARKERS[1])
        assert count == (2 if name(page) == "docs/benchmarks.md" else 0), name(page)
