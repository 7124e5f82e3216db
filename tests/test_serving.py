"""Serving (issue 31), first part: one served table. After any sequence of updates and deletes,
every id reads its last row (exactly in fp32, within fp16's rounding, within the bound of int8
row-wise quantization) and an id without a row reads the default, never another id's row;
lookups through fbgemm's inference op pool as a reference over those rows does."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchrec_kvzch.serving import ServedTable, decode, encode
from torchrec_kvzch.serving.table import error_bound


def reference_bags(rows: torch.Tensor, offsets: torch.Tensor, pooling: str, weights=None) -> torch.Tensor:
    """Dense bags; a weighted MEAN is row-wise sharding's: sum(w * row) / (sum(w) + 1e-6)."""
    if weights is not None:
        rows = rows * weights[:, None]
    if pooling == "none":
        return rows
    bags = [rows[a:b].sum(0) if b > a else torch.zeros(rows.shape[1]) for a, b in zip(offsets[:-1], offsets[1:])]
    out = torch.stack(bags)
    if pooling == "mean" and weights is not None:
        out = out / torch.stack([weights[a:b].sum() + 1e-6 for a, b in zip(offsets[:-1], offsets[1:])])[:, None]
    elif pooling == "mean":
        out = out / (offsets[1:] - offsets[:-1]).clamp(min=1)[:, None]
    return out


def int8_bound(w: torch.Tensor) -> torch.Tensor:
    return error_bound(w, "int8")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8"])
@given(seed=st.integers(0, 2**31 - 1), smallest=st.integers(-10, 0), constant=st.booleans(),
       offset=st.floats(-1e3, 1e3))
@settings(max_examples=40, deadline=None)
def test_encode_decode_is_exact_or_within_the_dtype_bound(dtype, seed, smallest, constant, offset):
    """Rows of magnitudes from 10^smallest to 100 (in the smallest, int8's scale is an fp16
    subnormal, or 0), constant rows, rows far from zero: each reads back within its bound."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 1 if constant else 16, generator=gen).expand(64, 16) * torch.logspace(smallest, 2, 64)[:, None]
    w = w + offset * torch.rand(64, 1, generator=gen)
    got = decode(encode(w, dtype), dtype)
    if dtype == "fp32":
        assert torch.equal(got, w)
    elif dtype == "fp16":
        assert torch.equal(got, w.half().float()) and ((got - w).abs() <= error_bound(w, "fp16")[:, None]).all()
    else:
        assert ((got - w).abs() <= int8_bound(w)[:, None]).all()


ops = st.lists(st.tuples(st.sampled_from(["upsert", "delete"]),
                         st.lists(st.integers(0, 60), min_size=1, max_size=25, unique=True)),
               min_size=1, max_size=12)


DEFAULT_STARTS = {0: None, 1: [0], 3: [0, 20, 45]}  # declared default rows -> the ids each serves from
# How a table maps ids: by the native op (CPU), or as on CUDA (kvzch::served_rows_py over the id
# map's other backends), rehearsed on the CPU; tests/test_cuda.py runs that on a GPU, with the
# rows padded to 16 bytes as fbgemm's CUDA op reads them.
LAYOUTS = {"cpu": {}, "cuda": {"id_map": "torch"}}


@settings(max_examples=40, deadline=None)
@given(ops=ops, dtype=st.sampled_from(["fp32", "fp16", "int8"]), pooling=st.sampled_from(["sum", "mean", "none"]),
       defaults=st.sampled_from(sorted(DEFAULT_STARTS)), weighted=st.booleans(), seed=st.integers(0, 2**16),
       layout=st.sampled_from(sorted(LAYOUTS)))
def test_after_any_updates_every_id_reads_its_last_row_or_the_default(ops, dtype, pooling, defaults, weighted, seed,
                                                                      layout):
    gen = torch.Generator().manual_seed(seed)
    dim = 8
    default_rows = torch.randn(defaults, dim, generator=gen) if defaults else None
    starts = DEFAULT_STARTS[defaults]
    table = ServedTable("t", dim, dtype, pooling, default_rows=default_rows, capacity=4,
                        default_starts=None if starts is None else torch.tensor(starts), **LAYOUTS[layout])
    truth: dict[int, torch.Tensor] = {}
    for op, ids in ops:
        if op == "upsert":
            rows = torch.randn(len(ids), dim, generator=gen)
            table.upsert(torch.tensor(ids), rows)
            truth.update(zip(ids, decode(encode(rows, dtype), dtype)))
        else:
            assert table.delete(torch.tensor(ids)) == len(truth.keys() & set(ids))
            for i in ids:
                truth.pop(i, None)
    assert len(table) == len(truth)
    absent = decode(encode(default_rows if defaults else torch.zeros(1, dim), dtype), dtype)
    which = (lambda i: 0) if starts is None else (lambda i: max(r for r, start in enumerate(starts) if i >= start))
    query = torch.randint(0, 70, (30,), generator=gen)
    expected = torch.stack([truth.get(int(i), absent[which(int(i))]) for i in query])
    assert torch.equal(table.weights(query), expected)
    offsets = torch.tensor([0, 0, 7, 19, 30])  # an empty bag too
    weights = torch.rand(30, generator=gen) if weighted and pooling != "none" else None
    got = table.lookup(query, offsets, weights)
    torch.testing.assert_close(got, reference_bags(expected, offsets, pooling, weights), rtol=1e-5, atol=1e-5)


def test_rows_survive_growth_and_deletes_move_no_other_row():
    table = ServedTable("t", 4, "fp32")
    ids = torch.arange(0, 5000) * 7919 + 2**40
    rows = torch.arange(5000 * 4, dtype=torch.float32).view(5000, 4)
    for chunk in range(0, 5000, 1000):  # past the reservation: the rows buffer grows
        table.upsert(ids[chunk:chunk + 1000], rows[chunk:chunk + 1000])
    gone = ids[::3]
    assert table.delete(torch.cat([gone, torch.tensor([12345])])) == gone.numel()  # an absent id: ignored
    kept = torch.ones(5000, dtype=torch.bool)
    kept[::3] = False
    assert torch.equal(table.weights(ids[kept]), rows[kept])
    assert torch.equal(table.weights(gone), torch.zeros(gone.numel(), 4))
    assert table.nbytes >= len(table) * table.row_bytes
    assert table.delete(ids[kept]) == int(kept.sum()) and len(table) == 0  # the pages of dead rows are released
    table.upsert(ids[:10], rows[:10])  # (and come back as needed)
    assert torch.equal(table.weights(ids[:10]), rows[:10])


def test_bad_input_names_the_table_and_changes_nothing():
    table = ServedTable("user", 8, "int8")
    table.upsert(torch.tensor([1, 2]), torch.ones(2, 8))
    before = table.rows[: len(table) + table.defaults].clone()
    for ids, rows, match in [
        (torch.tensor([3, 3]), torch.ones(2, 8), "served table 'user': an update names an id twice"),
        (torch.tensor([4]), torch.ones(1, 6), r"served table 'user': 1 ids with weights of shape \[1, 6\]"),
        (torch.tensor([-4]), torch.ones(1, 8), r"served table .user.: id -4 \(position 0"),
        (torch.tensor([5, 6]), torch.tensor([[1.0] * 8, [float("nan")] * 8]),
         r"served table 'user': the row of id 6 is not finite \(1 such row\(s\) in this update\)"),
        (torch.tensor([5]), torch.tensor([[-float("inf")] + [1.0] * 7]), "the row of id 5 is not finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            table.upsert(ids, rows)
    assert len(table) == 2 and torch.equal(table.rows[: len(table) + table.defaults], before)
    with pytest.raises(ValueError, match="served table 'user': dtype 'int4' is not served; use one of fp32, fp16, int8"):
        ServedTable("user", 8, "int4")
    with pytest.raises(ValueError, match=r"the row of id 1 exceeds fp16's range \(65504\); serve this table as fp32"):
        ServedTable("user", 8, "fp16").upsert(torch.tensor([1]), torch.full((1, 8), 7e4))
    # int8 keeps a row's minimum (its bias) and scale in fp16: beyond its range they read as NaN.
    for row in [torch.full((8,), 7e4), torch.tensor([-1e5] + [1.0] * 7), torch.linspace(0, 3e7, 8)]:
        table = ServedTable("user", 8, "int8")
        with pytest.raises(ValueError, match=r"the row of id 1 exceeds fp16's range \(65504\), which int8 rows "
                                             r"keep their scale and bias in; serve this table as fp32"):
            table.upsert(torch.tensor([1]), row[None])
        assert len(table) == 0
    # An fp16-stored table's unseen ids read its initial weights rounded to fp16, as training stores them.
    init = ServedTable("user", 8, initial=(-0.5, 0.5, 3)).weights(torch.tensor([9]))
    fp16 = ServedTable("user", 8, initial=(-0.5, 0.5, 3, "fp16")).weights(torch.tensor([9]))
    assert torch.equal(fp16, init.half().float()) and not torch.equal(fp16, init)
    with pytest.raises(ValueError, match=r"initial \(0, 1, 3, 'int8'\) is not \(low, high, seed\)"):
        ServedTable("user", 8, initial=(0, 1, 3, "int8"))
    with pytest.raises(ValueError, match="embedding_dim 7 is odd"):
        ServedTable("user", 7, "int8")
    with pytest.raises(ValueError, match="per-sample weights need a pooled table"):
        ServedTable("user", 8, pooling="none").lookup(torch.tensor([1]), torch.tensor([0, 1]), torch.ones(1))
    with pytest.raises(ValueError, match=r"default rows of shape \[2, 8\] for 1 default start"):
        ServedTable("user", 8, default_rows=torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"default_starts \[5, 3\] must ascend from the first id served, 5"):
        ServedTable("user", 8, default_rows=torch.ones(2, 8), default_starts=torch.tensor([5, 3]), id_range=(5, 9))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_replica_refuses_ids_outside_its_range_by_table_and_position(backend, monkeypatch):
    """A replica of some buckets serves their ids only: another id is a routing error, not a
    default row (it would silently read zeros)."""
    from torchrec_kvzch import native_status
    if backend == "native" and not native_status():
        pytest.skip("the native op is not built here")
    table = ServedTable("item", 4, id_range=(100, 200), id_map=backend)
    table.upsert(torch.tensor([150]), torch.ones(1, 4))
    for ids, bad, pos in ([150, 99, 151], 99, 1), ([200], 200, 0):
        with pytest.raises(ValueError, match=rf"served table 'item': id {bad} \(position {pos} of the batch\) "
                                             r"is outside the ids this table serves, \[100, 200\)"):
            table.lookup(torch.tensor(ids), torch.tensor([0, len(ids)]))
    with pytest.raises(ValueError, match="served table 'item': id 7 "):
        table.upsert(torch.tensor([7]), torch.ones(1, 4))
    assert torch.equal(table.weights(torch.tensor([150, 151])), torch.tensor([[1.0] * 4, [0.0] * 4]))


@settings(max_examples=20, deadline=None)
@given(stored=st.lists(st.integers(0, 2**62), max_size=300, unique=True),
       erased=st.lists(st.integers(0, 299), max_size=50), extra=st.lists(st.integers(0, 2**62), max_size=50),
       starts=st.lists(st.integers(1, 2**62), max_size=4, unique=True))
def test_the_served_row_ops_agree_with_the_torch_id_map(stored, erased, extra, starts):
    """``kvzch::served_rows`` (native, one pass: slot + k, or the default of the id's range) and
    ``kvzch::served_rows_py`` (any backend) read the rows the torch id map finds."""
    from torchrec_kvzch import native_status
    from torchrec_kvzch.table.id_map import IdMap
    from torchrec_kvzch.table.served_rows import served_rows_py
    if not native_status():
        pytest.skip("the native op is not built here")
    maps = [IdMap("native"), IdMap("torch")]
    for m in maps:
        m.find_or_insert(torch.tensor(stored, dtype=torch.long))
        m.erase(torch.tensor([stored[i] for i in erased if i < len(stored)], dtype=torch.long))
    query = torch.tensor(stored + extra, dtype=torch.long)
    starts = torch.tensor([0] + sorted(starts), dtype=torch.long)
    native = torch.ops.kvzch.served_rows(maps[0].table, query, starts, 0, 2**63 - 1, "t")
    slots = maps[1].find(query)
    reference = torch.where(slots >= 0, slots + starts.numel(), torch.searchsorted(starts, query, right=True) - 1)
    assert torch.equal(native, reference)
    assert torch.equal(served_rows_py(maps[1].table, query, starts, 0, 2**63 - 1, "t"), reference)


class Lookup(torch.nn.Module):
    """One served table's pooled lookup, as a module to export."""

    def __init__(self, table: ServedTable):
        super().__init__()
        self.table = table

    def forward(self, ids, offsets):
        return self.table.lookup(ids, offsets)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_served_table_exports_with_its_id_check(layout, tmp_path):
    """With their fake kernels, the id -> row ops trace into an exported program that runs as
    eager does (the served model's export builds on it), the range check included, and loads
    in a process that imports ``torchrec_kvzch.ops`` and no TorchRec."""
    import subprocess
    import sys
    from torchrec_kvzch import native_status
    if layout == "cpu" and not native_status():
        pytest.skip("the native op is not built here")
    table = ServedTable("t", 4, default_rows=torch.ones(2, 4), default_starts=torch.tensor([0, 30]),
                        id_range=(0, 100), **LAYOUTS[layout])
    table.upsert(torch.tensor([11, 22, 33]), torch.randn(3, 4))
    ids, offsets = torch.tensor([33, 5, 11, 22, 7, 40]), torch.tensor([0, 2, 6])
    n = torch.export.Dim("n", min=2)
    program = torch.export.export(Lookup(table), (ids, offsets), dynamic_shapes=({0: n}, None))
    assert torch.equal(program.module()(ids, offsets), table.lookup(ids, offsets))
    assert torch.equal(program.module()(ids[:3], torch.tensor([0, 1, 3])), table.lookup(ids[:3], torch.tensor([0, 1, 3])))
    with pytest.raises(ValueError, match=r"served table 't': id 100 \(position 1 of the batch\)"):
        program.module()(torch.tensor([33, 100]), torch.tensor([0, 1, 2]))
    torch.export.save(program, tmp_path / "t.pt2")
    torch.save((ids, offsets, table.lookup(ids, offsets)), tmp_path / "want.pt")
    script = f"""
import sys, torch
import torchrec_kvzch.ops
program = torch.export.load({str(tmp_path / 't.pt2')!r}).module()
ids, offsets, want = torch.load({str(tmp_path / 'want.pt')!r})
assert torch.equal(program(ids, offsets), want)
try:
    program(torch.tensor([33, 100]), torch.tensor([0, 1, 2]))
    raise SystemExit("an id outside the table was served")
except ValueError as e:
    assert "id 100 (position 1 of the batch)" in str(e), e
assert not [m for m in sys.modules if m == "torchrec" or m.startswith("torchrec.")], "TorchRec was imported"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_serving_options_refuse_a_device_fbgemm_cannot_serve_on():
    """Only cpu and cuda (where torch sees a GPU) serve; anything else is refused by name."""
    from torchrec_kvzch.serving import ServingOptions
    with pytest.raises(ValueError, match=r"ServingOptions.device 'meta': fbgemm's inference op serves on cpu or cuda"):
        ServingOptions(device="meta").check({"t"}, {"t"})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"ServingOptions.device 'cuda': torch sees no CUDA device here"):
            ServingOptions(device="cuda").check({"t"}, {"t"})
    ServingOptions(device="cpu").check({"t"}, {"t"})
