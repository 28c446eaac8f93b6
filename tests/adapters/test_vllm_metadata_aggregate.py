"""`KVTierWorkerMetadata.aggregate`: the later failed forward of any order of ranks, and
no sum with another connector's metadata."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvtier.adapters.vllm.metadata import KVTierWorkerMetadata


def test_aggregated_metadata_keeps_the_later_failed_forward_step() -> None:
    """A rank that failed at step 5 must fail the stores of plans older than 5, whatever
    an earlier fault (step 3) another rank reports beside it."""
    early, late, healthy = (KVTierWorkerMetadata(failed_forward_step=s) for s in (3, 5, None))
    assert early.aggregate(late).failed_forward_step == 5
    assert late.aggregate(early).failed_forward_step == 5
    assert healthy.aggregate(early).failed_forward_step == 3
    assert healthy.aggregate(healthy).failed_forward_step is None


class OtherMetadata(KVConnectorWorkerMetadata):
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self


def test_aggregating_another_connector_s_metadata_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="with OtherMetadata"):
        KVTierWorkerMetadata().aggregate(OtherMetadata())
