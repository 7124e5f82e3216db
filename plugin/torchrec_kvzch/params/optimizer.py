"""The fused optimizers of KV-ZCH tables, and the defaults of their settings."""

from __future__ import annotations

import enum


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


OPTIMIZER_DEFAULTS = {"optimizer": OptimizerKind.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01,
                      "eps": 1e-8, "stochastic_rounding": True}
