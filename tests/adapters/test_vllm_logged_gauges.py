"""vLLM's periodic log line shows every kvtier connector's gauges, each interval.

vLLM's `KVConnectorLogging` starts each logging interval with no stats: the line sums
only the payloads of that interval. A kvtier connector with nothing new sends no stats
(`SchedulerSide.take_stats`), so with two kvtier connectors in one `MultiConnector`, one
that sent nothing for a whole interval dropped out of the summed gauges (Prometheus
remembers each source and was right). Regression: each kvtier payload now also carries
the last gauges its sibling kvtier connectors sent, so the line sums every source's
last known values.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("vllm")

from busy_steps import busy_steps
from faulty_worker import FaultyWorker
from multi_connector import MultiWorker, multi_harness
from test_vllm_multi_connector_gauges import NAMES, PROMPTS, kvtier_children, true_gauges
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm_workers import ConnectorWorker

from kvtier.adapters.vllm import KVTierConnector


def logged_gauges(line: str) -> dict[str, float]:
    """Return the kvtier gauges of one `KV Transfer metrics:` line (0 where absent)."""
    (entry,) = re.findall(r"KVTierConnector=\{([^}]*)\}", line)
    values = dict(re.findall(r"'(\w+)': ([\d.]+)", entry))
    return {name: float(values.get(name, 0)) for name in NAMES}


def record_senders(children: list[Any], senders: list[int]) -> None:
    """Append a child's index to `senders` each time it returns stats."""
    for index, child in enumerate(children):
        take = child.get_kv_connector_stats

        def recording(take: Any = take, index: int = index) -> Any:
            stats = take()
            if stats is not None:
                senders.append(index)
            return stats

        child.get_kv_connector_stats = recording


def test_each_intervals_log_line_sums_every_kvtier_connectors_gauges() -> None:
    harness = multi_harness(order=("kvtier", "kvtier"))
    (worker,) = harness.workers
    assert isinstance(worker, MultiWorker)
    first, late = worker.children
    assert isinstance(first, ConnectorWorker)
    assert isinstance(late, ConnectorWorker)
    # Both children's copies stepped (each poll waits for the jobs started), so the step
    # each reports its stores in does not depend on copy threads: left to its threads,
    # the first child reported in the stores' own step (then no interval had one child
    # alone) or, on a loaded machine, as late as the second child.
    early = FaultyWorker(first.connector.worker_side.worker, lambda blocks: None)
    early.hold["store"] = 1  # the first child's stores are reported the step after
    faulty = FaultyWorker(late.connector.worker_side.worker, lambda blocks: None)
    faulty.hold["store"] = 4  # the second child's stores stay pending 4 steps longer
    logging = KVConnectorLogging(harness.vllm_config.kv_transfer_config)
    senders: list[int] = []
    record_senders(kvtier_children(harness), senders)
    num_lines = num_alone = 0
    lines: list[str] = []
    for request_id, prompt in PROMPTS.items():
        harness.add_request(request_id, prompt, 3)
    for record in busy_steps(harness):
        sent = senders.copy()  # this step's senders
        senders.clear()
        for outputs in record.outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                logging.observe(stats.kv_connector_stats)
        lines.clear()
        logging.log(lambda fmt, *args: lines.append(fmt % args))  # one-step intervals
        if not lines:
            continue
        (line,) = lines
        truth = {name: float(value) for name, value in true_gauges(harness).items()}
        assert logged_gauges(line) == truth, line
        num_lines += 1
        silent = kvtier_children(harness)[1 - sent[0]] if len(sent) == 1 else None
        if silent is not None and any(silent.scheduler_side.offload.stats_gauges()):
            num_alone += 1  # a connector with gauges above 0 sent nothing this interval
    assert num_lines
    assert num_alone
    assert KVTierConnector.__name__ in line
    harness.close()
