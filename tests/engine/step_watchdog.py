"""A step cap for an engine under test: a hang fails the test instead of blocking pytest."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.engine.llm import LLM


def with_watchdog(llm: LLM, max_steps: int) -> Callable[[], None]:
    """Make `llm.step` raise after `max_steps` steps; return a function that re-arms it.

    A request that can never be scheduled, or stores that never drain, would make
    `generate` or `drain` spin forever; an idle step sleeps 0.5 ms, so the cap is seconds.
    """
    step = llm.step
    left = [0]

    def guarded() -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise AssertionError(f"no progress within {max_steps} engine steps")
        return step()

    def arm() -> None:
        left[0] = max_steps

    llm.step = guarded  # type: ignore[method-assign]
    return arm
