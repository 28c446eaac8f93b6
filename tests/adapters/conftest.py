"""Every `VllmHarness` a test builds is closed at its teardown at the latest: its workers
shut down (transfer threads stopped, tiers released) before the next test starts.

Module-scoped fixtures' harnesses, built before the test, are left to their fixture.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from open_harnesses import OPEN, close_opened_since


@pytest.fixture(autouse=True)
def _harnesses_closed() -> Iterator[None]:
    before = list(OPEN)
    yield
    close_opened_since(before)
