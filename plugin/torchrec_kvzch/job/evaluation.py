"""Evaluation on the log's held-out slice, with TorchRec's own metric functions: AUC
(``torchrec.metrics.auc``) and normalized entropy (``torchrec.metrics.ne``), over all ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.ne import compute_cross_entropy, compute_ne

from torchrec_kvzch.job.model import predict

_ETA = 1e-12  # TorchRec's clamp of probabilities away from 0 and 1


def evaluate(model, data, batches: int, rank: int, world_size: int) -> dict[str, float]:
    """AUC and NE of the model's predictions on ``batches`` held-out global batches (each rank
    predicts its slice; the predictions are gathered, so every rank returns the same numbers).
    Predicting creates no rows and changes none: training goes on as if it had not run."""
    predictions, labels = [], []
    for i in range(batches):
        batch = data.heldout(i, rank, world_size)
        predictions.append(predict(model, batch).view(-1).double())
        labels.append(batch.labels.view(-1).double())
    local = torch.stack([torch.cat(predictions), torch.cat(labels)])
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    p, y = torch.cat(gathered, dim=1)
    w = torch.ones_like(y)
    auc = compute_auc(1, [p.view(1, -1)], [y.view(1, -1)], [w.view(1, -1)])
    ce_sum = compute_cross_entropy(y, p.clone(), w, _ETA).sum()  # (it clamps in place)
    ne = compute_ne(ce_sum, w.sum(), y.sum(), (1 - y).sum(), _ETA)
    return {"auc": auc.item(), "ne": ne.item(), "examples": int(y.numel())}
