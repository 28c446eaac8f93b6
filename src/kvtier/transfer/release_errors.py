"""Which of the errors met while releasing several resources is the one to raise."""

from __future__ import annotations

from collections.abc import Sequence


def error_to_raise(errors: Sequence[BaseException]) -> BaseException:
    """Return the first interrupt among `errors` (a BaseException that is not an
    Exception: KeyboardInterrupt, SystemExit), else the first error.

    A release keeps going past each failure so that nothing stays held; once it is done,
    an interrupt must still end the program as the user asked, whatever failed before it.
    """
    if not errors:
        raise ValueError("error_to_raise needs at least one error")
    return next((e for e in errors if not isinstance(e, Exception)), errors[0])
