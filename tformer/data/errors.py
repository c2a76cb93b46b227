"""The one error type of the data pipeline, and the checks shared by its modules."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input to the data pipeline.

    The message is one line that names the file, column or number at fault and says what to do.
    The CLI prints it as ``error: <message>`` and exits with status 2.
    """


def check_seq_len(seq_len: int, max_len: int | None, what: str = "sequence length") -> None:
    """Refuse a sequence length the model cannot take (``max_len`` None means unbounded, e.g. T5)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"{what} must be a positive integer, got {seq_len!r}")
    if max_len is not None and seq_len > max_len:
        raise DataError(
            f"{what} {seq_len} exceeds the model's maximum of {max_len} positions: "
            f"lower the sequence length to <= {max_len} or build the model with more positions"
        )
