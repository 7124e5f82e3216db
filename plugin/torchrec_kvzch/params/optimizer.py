"""The fused optimizers of KV-ZCH tables, and the defaults of their settings."""

from __future__ import annotations

import enum

from torchrec_kvzch.params.checks import member


class OptimizerKind(str, enum.Enum):
    """The fused optimizers of KV-ZCH tables; values are fbgemm's ``EmbOptimType`` names.

    Both keep their state in the store's rows and bind to fbgemm's TBE in place. Adam cannot:
    fbgemm has no CPU Adam, and its CUDA Adam wants the two moments as two flat tensors, where a
    row keeps them side by side; ``parse`` refuses it (and every other fbgemm optimizer) with
    that reason rather than accept a table no kernel can train."""

    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    EXACT_SGD = "exact_sgd"

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
        why = (" (fbgemm has no CPU Adam, and its CUDA Adam needs the two moments apart, which "
               "the row store keeps together in each row)" if "adam" in str(value).lower() else "")
        return f"{value!r} is not supported{why}; use one of {', '.join(k.name.lower() for k in cls)}"

    def state_floats(self, embedding_dim: int) -> int:
        """fp32 optimizer values kept per row (rowwise Adagrad: one accumulator; SGD: none)."""
        return {OptimizerKind.EXACT_ROWWISE_ADAGRAD: 1, OptimizerKind.EXACT_SGD: 0}[self]

    def to_fbgemm(self):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        return EmbOptimType(self.value)


class WeightDecayMode(str, enum.Enum):
    """How ``weight_decay`` enters a table's update; names as fbgemm's ``WeightDecayMode``.

    ``DECOUPLE`` shrinks the row by ``learning_rate * weight_decay`` apart from the gradient;
    ``L2`` adds ``weight_decay * w`` to the gradient, which for SGD is the same step
    (``w * (1 - lr * wd) - lr * g``). The table applies the decay itself (fbgemm's SGD has none,
    its CPU rowwise Adagrad drops it); rowwise Adagrad with ``L2``, whose term must enter the
    accumulator, is refused until the table's own update does that. fbgemm's
    ``COUNTER``, ``COWCLIP`` and ``DECOUPLE_GLOBAL`` need per-row counters or a global step that
    the rows do not keep: refused."""

    NONE = "none"
    L2 = "l2"
    DECOUPLE = "decouple"

    @classmethod
    def parse(cls, value: "WeightDecayMode | str", table: str = "?") -> "WeightDecayMode":
        """Ours, its value, or fbgemm's ``WeightDecayMode`` (an int enum: by its name)."""
        if isinstance(value, enum.Enum) and not isinstance(value, cls):
            value = value.name

        def fail(problem: str):
            why = (" (it needs per-row counters or a global step the rows do not keep)"
                   if str(value).lower() in _NEEDS_STATE else "")
            raise ValueError(f"KV-ZCH table '{table}': {problem}{why}")
        return member(cls, value, "weight_decay_mode", fail)


_NEEDS_STATE = {"counter", "cowclip", "decouple_global"}

OPTIMIZER_DEFAULTS = {"optimizer": OptimizerKind.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01,
                      "eps": 1e-8, "stochastic_rounding": True, "weight_decay": 0.0,
                      "weight_decay_mode": WeightDecayMode.NONE}
