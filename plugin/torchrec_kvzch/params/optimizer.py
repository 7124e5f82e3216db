"""The fused optimizers of KV-ZCH tables, and the defaults of their settings."""

from __future__ import annotations

import enum

from torchrec_kvzch.params.checks import member


class OptimizerKind(str, enum.Enum):
    """The fused optimizers of KV-ZCH tables; values are fbgemm's ``EmbOptimType`` names.

    Every one keeps its state in the store's rows, in upstream's whole-row layout. Row-wise
    Adagrad and SGD bind fbgemm's TBE to the rows; Adam and partial row-wise Adam run the
    table's own update (``table/row_optimizers.py``): fbgemm has no CPU Adam, and its CUDA Adam
    keeps the moments in flat tensors of its own. ``parse`` refuses the other fbgemm optimizers
    (no KV-ZCH backend upstream trains them either)."""

    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    EXACT_SGD = "exact_sgd"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_row_wise_adam"

    @classmethod
    def parse(cls, value: "OptimizerKind | str", table: str = "?") -> "OptimizerKind":
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower()
        for kind in cls:
            if key in (kind.value, kind.name.lower()):
                return kind
        raise ValueError(f"KV-ZCH table '{table}': optimizer {cls.refusal(value)}")

    @classmethod
    def refusal(cls, value) -> str:
        """Why ``value`` is not an optimizer of KV-ZCH tables, and what to use instead."""
        return (f"{value!r} is not supported (upstream's KV-ZCH tables train with these alone); "
                f"use one of {', '.join(k.name.lower() for k in cls)}")

    def state_floats(self, embedding_dim: int) -> int:
        """fp32 optimizer values kept per row: row-wise Adagrad's accumulator; Adam's two
        moments per element; partial row-wise Adam's second moment per row and first per
        element; SGD none."""
        return {OptimizerKind.EXACT_ROWWISE_ADAGRAD: 1, OptimizerKind.EXACT_SGD: 0,
                OptimizerKind.ADAM: 2 * embedding_dim,
                OptimizerKind.PARTIAL_ROWWISE_ADAM: embedding_dim + 1}[self]

    def state_names(self, embedding_dim: int) -> tuple[tuple[str, int, int], ...]:
        """The state a row keeps, as TorchRec names it: (name, first column, columns)."""
        dim = embedding_dim
        return {OptimizerKind.EXACT_ROWWISE_ADAGRAD: (("momentum1", 0, 1),), OptimizerKind.EXACT_SGD: (),
                OptimizerKind.ADAM: (("momentum1", 0, dim), ("momentum2", dim, dim)),
                OptimizerKind.PARTIAL_ROWWISE_ADAM: (("momentum1", 1, dim), ("momentum2", 0, 1))}[self]

    @property
    def adam(self) -> bool:
        """Whether it reads ``beta1`` / ``beta2``."""
        return self in (OptimizerKind.ADAM, OptimizerKind.PARTIAL_ROWWISE_ADAM)

    def to_fbgemm(self):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        return EmbOptimType(self.value)


class WeightDecayMode(str, enum.Enum):
    """How ``weight_decay`` enters a table's update; names as fbgemm's ``WeightDecayMode``.

    ``DECOUPLE`` shrinks the row by ``learning_rate * weight_decay`` apart from the gradient;
    ``L2`` adds ``weight_decay * w`` to the gradient, which for SGD is the same step
    (``w * (1 - lr * wd) - lr * g``). The table applies the decay itself (fbgemm's SGD has none,
    its CPU rowwise Adagrad drops it; ``table/row_optimizers.py``). fbgemm's ``COUNTER``,
    ``COWCLIP`` and ``DECOUPLE_GLOBAL`` need per-row counters or a global step that the rows do
    not keep: refused."""

    NONE = "none"
    L2 = "l2"
    DECOUPLE = "decouple"

    @classmethod
    def parse(cls, value: "WeightDecayMode | str", table: str = "?") -> "WeightDecayMode":
        """Ours, its value, or fbgemm's ``WeightDecayMode`` (an int enum: by its name)."""
        if isinstance(value, enum.Enum) and not isinstance(value, cls):
            value = value.name

        def fail(problem: str):
            raise ValueError(f"KV-ZCH table '{table}': {problem}")
        if str(value).lower() in _NEEDS_STATE:
            fail(f"weight_decay_mode {value!r} is fbgemm's, but not supported by KV-ZCH tables: it needs "
                 "per-row counters or a global step the rows do not keep (upstream's KV-ZCH TBE refuses it "
                 f"too); use one of {', '.join(m.value for m in cls)}")
        return member(cls, value, "weight_decay_mode", fail)


_NEEDS_STATE = {"counter", "cowclip", "decouple_global"}

OPTIMIZER_DEFAULTS = {"optimizer": OptimizerKind.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01,
                      "eps": 1e-8, "stochastic_rounding": True, "weight_decay": 0.0,
                      "weight_decay_mode": WeightDecayMode.NONE, "beta1": 0.9, "beta2": 0.999}
