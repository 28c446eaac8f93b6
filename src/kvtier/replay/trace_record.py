"""A trace's record (`TraceRecord`) and the error a malformed one raises (`TraceError`),
shared by the reader (`trace`) and the checks (`trace_checks`)."""

from __future__ import annotations

from dataclasses import dataclass


class TraceError(ValueError):
    """A trace record is malformed; the message names the file and line (or, for records
    handed to the replay directly, the record's index)."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, index: int, block_size: int) -> int:
        """Return how many prompt tokens block `index` covers (the last may be partial)."""
        return min(block_size, self.input_length - index * block_size)
