"""error_to_raise: an interrupt met while releasing wins over any failure."""

from __future__ import annotations

import pytest

from kvtier.transfer.release_errors import error_to_raise


def test_the_first_interrupt_wins_else_the_first_error() -> None:
    oserror, runtime = OSError("disk"), RuntimeError("cuda")
    interrupt, exiting = KeyboardInterrupt(), SystemExit(1)
    assert error_to_raise([oserror, runtime]) is oserror
    assert error_to_raise([oserror, interrupt, exiting]) is interrupt
    assert error_to_raise([runtime, exiting]) is exiting


def test_no_errors_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="at least one error"):
        error_to_raise([])
