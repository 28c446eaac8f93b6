"""An engine killed between steps leaves no record of a disk copy its scheduler dropped.

The files a kill leaves are those on disk at that moment: the test copies the directory
(slot file and manifest, appended without a sync) while the engine runs, and restarts
from the copy. Regression: the records of copies a report made the scheduler drop went
with the next plan; killed before it (an idle engine waits for its next request), the
engine left them, and a restart restored the 5 blocks a failed disk load had dropped.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from test_llm_persist_dropped import (
    ENGINE,
    MODEL,
    Faults,
    disk_copies,
    held_on_the_tiers_only,
    persistent,
    step_until_its_disk_load_failed,
)

from kvtier.engine.llm import LLM


def test_a_kill_right_after_a_failed_disk_load_leaves_no_record_of_it(tmp_path: Path) -> None:
    live, killed = tmp_path / "live", tmp_path / "killed"
    live.mkdir()
    with LLM(MODEL, kv_offload=persistent(live, cascade=False), engine=ENGINE) as llm:
        faults = held_on_the_tiers_only(llm, Faults)
        step_until_its_disk_load_failed(llm, faults)
        assert not disk_copies(llm)  # the scheduler dropped them
        shutil.copytree(live, killed)  # what a kill now leaves
    with LLM(MODEL, kv_offload=persistent(killed, cascade=False), engine=ENGINE) as llm:
        assert not disk_copies(llm)
