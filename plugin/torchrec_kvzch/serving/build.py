"""Served tables built from a checkpoint's chain, and deltas applied to them.

A KV-ZCH table is built from its full checkpoint's rows, then each delta of the chain in order:
the ids it deleted leave the table, its rows replace or join the others. Rows stream in a chunk
at a time (``source.Link.rows``), so a build holds the served table and one chunk, never the
checkpoint's rows twice. Every file the build will read is checked to exist and be complete
before the first row is served, and every chunk against its checksum as it is read; a build
that fails leaves nothing behind (it makes a new table; what is being served is not touched).
"""

from __future__ import annotations

import torch

from torchrec_kvzch.params import KVZCHTableParams
from torchrec_kvzch.serving.source import Link, SavedKVTable
from torchrec_kvzch.serving.table import ServedTable
from torchrec_kvzch.torchrec.delta import DELETED

# What an id without a row reads: admission's default row (zeros without one), zeros, or what
# training's evaluation reads (the initial weights a row of it would start with; on a table with
# admission, its default row).
DEFAULTS = ("admission", "zeros", "initial")


def bucket_ids(table: SavedKVTable, buckets: tuple[int, int] | None) -> tuple[int, int]:
    """The ids of buckets ``[start, end)`` of ``table`` (None: all of them)."""
    total, size = table.saved.total_num_buckets, table.params.bucket_size
    start, end = (0, total) if buckets is None else buckets
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= total):
        raise ValueError(f"served table '{table.saved.name}': buckets {buckets!r} are not a range of its "
                         f"{total} buckets; pass (start, end) with 0 <= start < end <= {total}")
    return start * size, end * size


def find_table(link: Link, name: str) -> SavedKVTable:
    table = link.tables.get(name)
    if table is None:
        raise ValueError(f"{link.path} has no KV-ZCH table '{name}'; it has "
                         f"{sorted(link.tables) or 'none'}")
    return table


def check_chain(chain: list[Link], name: str) -> SavedKVTable:
    """The table as the chain's last link saved it, after checking that every link saved it
    with the same geometry."""
    last = find_table(chain[-1], name)
    for link in chain[:-1]:
        saved = find_table(link, name).saved
        for field in ("embedding_dim", "num_embeddings", "total_num_buckets"):
            if getattr(saved, field) != getattr(last.saved, field):
                raise ValueError(f"{link.path}: KV-ZCH table '{name}' was saved with {field} "
                                 f"{getattr(saved, field)}, the chain's last link {chain[-1].path} with "
                                 f"{getattr(last.saved, field)}; the chain is not one table's")
    return last


def build_table(chain: list[Link], name: str, *, dtype: str = "fp32", pooling: str = "sum",
                buckets: tuple[int, int] | None = None, default: str = "admission",
                params: KVZCHTableParams | None = None, device: str | torch.device = "cpu") -> ServedTable:
    """KV-ZCH table ``name`` as ``chain`` (a full checkpoint, then its deltas) restores it,
    its ids in ``buckets`` only, on ``device``. ``default``: what an id without a row reads:
    ``admission`` (the table's trainable default row where it has one, else zeros), ``zeros``,
    or ``initial`` (what training's evaluation reads: the id-seeded weights of ``params``, the
    table's parameters as trained; on a table saved with admission, ``admission``'s rows)."""
    if default not in DEFAULTS:
        raise ValueError(f"served table '{name}': default {default!r} is unknown; use one of "
                         f"{', '.join(DEFAULTS)}")
    table = check_chain(chain, name)
    if default == "initial" and chain[-1].admits(table):
        default = "admission"
    if default == "initial" and params is None:
        raise ValueError(f"served table '{name}': default 'initial' needs the table's parameters as trained "
                         "(their init_range and init_seed); pass them")
    for field in ("embedding_dim", "num_embeddings", "total_num_buckets") if params is not None else ():
        if getattr(params, field) != getattr(table.saved, field):
            raise ValueError(f"served table '{name}': its parameters give {field} {getattr(params, field)}, "
                             f"{chain[-1].path} saved it with {getattr(table.saved, field)}; pass the "
                             "parameters it was trained with")
    lo, hi = bucket_ids(table, buckets)
    rows, starts = default_rows(chain[-1], table, lo, hi, default)
    for link in chain:  # every file checked before the first row is read
        check_link(link, find_table(link, name), lo, hi)
    expected = sum(table.saved.rows[r] for r in table.ranks_in(lo, hi))
    initial = (*params.init_range, params.init_seed, table.saved.weight_dtype) if default == "initial" else None
    served = ServedTable(name, table.saved.embedding_dim, dtype, pooling, default_rows=rows, capacity=expected,
                         default_starts=starts, id_range=(lo, hi), initial=initial, device=device)
    for link in chain:
        apply(link, served, name)
    return served


def default_rows(link: Link, table: SavedKVTable, lo: int, hi: int,
                 default: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(default rows, the first id each serves) for ids ``[lo, hi)`` as ``link`` saved the
    table: with ``default`` "admission" and a trainable default row, each saving rank's own,
    for the ids it trained; else (None, None), one zero row."""
    trained = link.default_rows(table) if default == "admission" else None
    if trained is None:
        return None, None
    ranks, ids = table.ranks_in(lo, hi), table.rank_ids()
    return trained[ranks], torch.tensor([max(ids[r][0], lo) for r in ranks], dtype=torch.long)


def check_link(link: Link, table: SavedKVTable, lo: int, hi: int) -> None:
    """Every file region of ``link`` that serving ids ``[lo, hi)`` of ``table`` reads (its rows,
    and a delta's deleted ids) exists and is complete."""
    link.check(link.chunks(table, lo, hi) + (link.chunks(table, lo, hi, DELETED) if link.is_delta else []))


def apply(link: Link, served: ServedTable, name: str) -> None:
    """One link's rows onto ``served``: a delta's deleted ids first, then its rows."""
    table = find_table(link, name)
    if table.saved.embedding_dim != served.dim:
        raise ValueError(f"{link.path}: KV-ZCH table '{name}' was saved with embedding_dim "
                         f"{table.saved.embedding_dim}, the served table has {served.dim}")
    lo, hi = served.id_range
    if link.is_delta:
        served.delete(link.deleted(table, lo, hi))
    for ids, weights in link.rows(table, lo, hi):
        served.upsert(ids, weights)
