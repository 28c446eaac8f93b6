import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from pathlib import Path
import pytest
from test_llm_persist_reset import persistent, restart, reference, update_weights, assert_same, PROMPT, PARAMS, MODEL, ENGINE
from kvtier.engine.llm import LLM
from kvtier.offload.config import CascadeMode

@pytest.mark.parametrize("cascade", [None, CascadeMode.WRITE_THROUGH, CascadeMode.WRITE_BACK])
def test_reset_then_shutdown(tmp_path: Path, cascade) -> None:
    config = persistent(tmp_path, cascade)
    with LLM(MODEL, config, ENGINE) as llm:
        llm.generate([PROMPT], PARAMS)
        llm.drain()
        assert llm.offload.scheduler.reset()
        # no step: shutdown at once
    _, restored = restart(config)
    assert restored == 0, "a reset's end of persistence never reached the worker"
