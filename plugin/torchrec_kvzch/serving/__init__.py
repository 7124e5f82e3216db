"""Serving trained KV-ZCH tables: their rows without optimizer state, quantized as fbgemm's
inference TBE reads them (issue 31; the first part: one served table)."""

from torchrec_kvzch.serving.table import SERVED_DTYPES, ServedTable, decode, encode

__all__ = ["SERVED_DTYPES", "ServedTable", "decode", "encode"]
