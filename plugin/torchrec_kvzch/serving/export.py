"""The served model as a ``torch.export`` program: a file that a process without TorchRec loads.

``export_served(model, args)`` traces a served model (``model.served_model``) whose last input
is a ``KeyedJaggedTensor``; the program takes the same inputs with the KJT replaced by plain
tensors, ``values`` and ``lengths`` (and ``weights`` for weighted features) in the KJT's key
order, and returns TorchRec outputs as plain tensors (a ``KeyedTensor``'s values, each
``JaggedTensor``'s values), so loading it needs no TorchRec: only torch, fbgemm_gpu (its
inference op) and our ops (the id -> row step, registered with fake kernels, the id check
included)::

    import torch
    import torchrec_kvzch.ops               # our ops and fbgemm's; no TorchRec
    program = torch.export.load("model.pt2").module()
    scores = program(dense, values, lengths)

A program made on CPU with the native op calls C++ ops only: ``import fbgemm_gpu`` and
``torch.ops.load_library(native_library())`` (of the environment that built it) load it too.

The batch size and the number of ids are dynamic. The served rows are constants of the program:
a program is one version of the model (a follower serves new versions eagerly).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.export import Dim
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor


class _PlainInputs(nn.Module):
    """``model`` with its KJT input taken as ``values``, ``lengths`` (and ``weights``)."""

    def __init__(self, model: nn.Module, keys: list[str], weighted: bool) -> None:
        super().__init__()
        self.model, self.keys, self.weighted = model, keys, weighted

    def forward(self, *args):
        if self.weighted:
            *dense, values, lengths, weights = args
        else:
            (*dense, values, lengths), weights = args, None
        kjt = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths, weights=weights)
        return _plain(self.model(*dense, kjt))


def _plain(out):
    """TorchRec outputs as plain tensors: a ``KeyedTensor``'s values, a ``JaggedTensor``'s
    values (its lengths are the input's), inside tuples, lists and dicts too."""
    if isinstance(out, KeyedTensor):
        return out.values()
    if isinstance(out, JaggedTensor):
        return out.values()
    if isinstance(out, dict):
        return {k: _plain(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_plain(v) for v in out)
    return out


def export_served(model: nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """Export served ``model`` on example ``args`` (the KJT last; its batch at least 1)."""
    *dense, kjt = args
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"export_served: the last example input must be a KeyedJaggedTensor, got {type(kjt).__name__}")
    weighted = kjt.weights_or_none() is not None
    batch, ids = Dim("batch", min=1), Dim("ids", min=1)
    features = len(kjt.keys())
    shapes = [{0: batch} if isinstance(t, torch.Tensor) and t.dim() else None for t in dense]
    shapes += [{0: ids}, {0: features * batch}] + ([{0: ids}] if weighted else [])
    inputs = (*dense, kjt.values(), kjt.lengths()) + ((kjt.weights(),) if weighted else ())
    # Size-oblivious: a batch of one must not specialise the program to it.
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return torch.export.export(_PlainInputs(model.eval(), list(kjt.keys()), weighted), inputs,
                                   dynamic_shapes=(tuple(shapes),), strict=False)  # (one *args)


def native_library() -> str:
    """The path of our op library, for ``torch.ops.load_library`` where a program is loaded."""
    from torchrec_kvzch import _C

    return os.path.abspath(_C.__file__)
