"""The native op (``csrc/``, built by setup.py as ``torchrec_kvzch._C``): whether it loaded,
and the memory helpers built on it. Everything that uses the op has a torch twin, so a missing
op costs speed, never correctness."""

from __future__ import annotations

import math
import platform

import torch


def _load_native() -> tuple[bool, str]:
    if platform.machine().lower() in ("x86_64", "amd64") and not torch.cpu._is_avx2_supported():
        # Built with AVX2 (setup.py): loading it here would fault at its first vector instruction.
        return False, "this x86-64 CPU lacks AVX2, which the op is built for; the torch backend serves"
    try:
        from torchrec_kvzch import _C  # noqa: F401  (registers torch.ops.kvzch.*)
    except ImportError as e:
        return False, f"{e}"
    return True, "loaded"


_NATIVE_OK, NATIVE_WHY = _load_native()


def native_status(strict: bool = False) -> bool:
    """Whether the native op is available; with ``strict`` its absence is an error."""
    if strict and not _NATIVE_OK:
        raise RuntimeError(
            f"torchrec_kvzch native op is unavailable ({NATIVE_WHY}); if it is not built, "
            "reinstall with `pip install --no-build-isolation -e .` (or run `make venv`)"
        )
    return _NATIVE_OK


HUGEPAGE_BYTES = 2 << 20


def empty_large(shape, dtype: torch.dtype, device: torch.device, native: bool,
                reserve: int = 0, host: bool = False) -> torch.Tensor:
    """``torch.empty`` for the store's big CPU buffers: with the native op, a mapping of their own
    (huge pages advised, memory back to the OS as soon as it is freed; see ``empty_mapped``).
    ``reserve``: rows of address space to map beyond ``shape[0]``, so that ``regrown`` can
    later grow the buffer in place; untouched pages cost no memory. ``host`` on CUDA: in host
    memory the GPU reads and writes over the bus (fbgemm's managed memory, placed on the host;
    pages are allocated as they are first written, so a reservation costs none either)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    row_bytes = math.prod(shape[1:]) * torch.empty(0, dtype=dtype).element_size()
    nbytes = max(shape[0], reserve) * row_bytes
    if host and device.type == "cuda":
        elements = max(1, max(shape[0], reserve) * math.prod(shape[1:]))
        space = torch.ops.fbgemm.new_unified_tensor(torch.zeros(1, dtype=dtype, device=device), [elements], False)
        return space[: math.prod(shape)].view(shape)
    if native and device.type == "cpu" and nbytes >= 4 * HUGEPAGE_BYTES:
        space = torch.ops.kvzch.empty_mapped(nbytes).view(dtype)
        return space[: math.prod(shape)].view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


def regrown(tensor: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``tensor`` (from ``empty_large``) resized to ``rows`` rows in place, keeping its rows, when
    its mapping has the room; else None (the caller copies into a new buffer)."""
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    storage = tensor.untyped_storage()
    if tensor.storage_offset() or not tensor.is_contiguous() or storage.nbytes() < rows * row_bytes:
        return None
    return tensor.new_empty(0).set_(storage, 0, (rows, *tensor.shape[1:]))


def release_rows(tensor: torch.Tensor, start: int, end: int, native: bool) -> None:
    """Give the memory of rows ``[start, end)`` of a CPU buffer back to the OS (whole pages only;
    they read as zeros if touched again): dead rows past a store's end after a compaction."""
    if native and tensor.device.type == "cpu" and end > start and tensor.numel():  # SGD: no state
        row_bytes = tensor.stride(0) * tensor.element_size()
        torch.ops.kvzch.release_pages(tensor, start * row_bytes, end * row_bytes)
