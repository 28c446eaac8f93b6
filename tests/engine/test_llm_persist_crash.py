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
    PARAMS,
    PROMPT,
    Faults,
    disk_copies,
    evict_gpu,
    persistent,
)

from kvtier.engine.llm import LLM
from kvtier.offload.plan import Tier


def test_a_kill_right_after_a_failed_disk_load_leaves_no_record_of_it(tmp_path: Path) -> None:
    live, killed = tmp_path / "live", tmp_path / "killed"
    live.mkdir()
    with LLM(MODEL, kv_offload=persistent(live, cascade=False), engine=ENGINE) as llm:
        assert llm.offload is not None
        faults = llm.offload.worker = Faults(llm.offload.worker)  # type: ignore[assignment]
        llm.generate([PROMPT], PARAMS)
        llm.drain()
        evict_gpu(llm)
        faults.fail = lambda job: job.src_tier is Tier.DISK
        llm.add_request(PROMPT, PARAMS)
        for _ in range(10):  # until the step whose report fails the load
            if faults.failed_once:
                break
            llm.step()
        assert faults.failed_once
        assert not disk_copies(llm)  # the scheduler dropped them
        shutil.copytree(live, killed)  # what a kill now leaves
    with LLM(MODEL, kv_offload=persistent(killed, cascade=False), engine=ENGINE) as llm:
        assert not disk_copies(llm)
