"""Trace replay: kvtier's tier index and policies under a recorded or generated workload.

| module | holds |
|---|---|
| `trace` | Mooncake-format records: read (validated, errors name the line), write, summarize |
| `trace_record` | `TraceRecord`, `TraceError` |
| `trace_checks` | the checks of every record, read or handed to the API (`TraceChecker`) |
| `trace_values` | a trace's bad value in an error, as written in the file (`true`, `1e400`) |
| `config` | `ReplayConfig`, `TierConfig`, `ReleaseOrder`, `CascadeMode` and the frozen results |
| `tier_replay` | `TierReplay`: one pass through a GPU pool and the lower tiers' `BlockPool`s |
| `tier_store` | one lower tier's state; store selection and release (shared) |
| `cascade` | the CPU → DISK cascade: mixed lookup, write-through, write-back demotion |
| `belady` | offline policies reading the future: `belady`, `oracle-lfu` (`FutureOracle`) |
| `cost` | the TTFT cost model |
| `sweep` | many (policy, capacity) passes; CSV, JSON, plot |
| `generate` | the multi-turn chat workload generator |
| `cli` | `kvtier replay` / `python -m kvtier.replay` |
| `plan` | the CLI's options, output paths and trace checked into a `ReplayPlan` before a run |
| `outputs` | checks that `--json` / `--out` can be written |
| `report` | exact capacity labels (`1000001`, `1M`, `10G`) and the results table |
| `store_once` | `StoreOnce`: a single-valued CLI option given twice is a usage error |
| `ascii_number` | `ascii_int`, `ascii_float`: numeric CLI options in ASCII digits only |
"""

from __future__ import annotations

# The names below are imported on first use (PEP 562), not with the package:
# `python -m kvtier.replay` imports the package before its `__main__` runs, where
# Ctrl-C is one line and status 130 (`kvtier.cli.main`), not a traceback.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from kvtier.replay.config import (
        CascadeMode,
        ReleaseOrder,
        ReplayConfig,
        ReplayError,
        ReplayResult,
        TierConfig,
    )
    from kvtier.replay.tier_replay import TierReplay, replay_trace
    from kvtier.replay.trace import TraceError, TraceRecord, read_trace

_HOME = {
    "CascadeMode": "config",
    "ReleaseOrder": "config",
    "ReplayConfig": "config",
    "ReplayError": "config",
    "ReplayResult": "config",
    "TierConfig": "config",
    "TierReplay": "tier_replay",
    "replay_trace": "tier_replay",
    "TraceError": "trace",
    "TraceRecord": "trace",
    "read_trace": "trace",
}


if not TYPE_CHECKING:  # type checkers see the imports above: a misspelt name is an error

    def __getattr__(name: str) -> object:
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib  # not with the package: `python -m kvtier.replay` starts here

        value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_HOME})


__all__ = [
    "CascadeMode",
    "ReleaseOrder",
    "ReplayConfig",
    "ReplayError",
    "ReplayResult",
    "TierConfig",
    "TierReplay",
    "TraceError",
    "TraceRecord",
    "read_trace",
    "replay_trace",
]
