"""WorkerConfig's refusals at their edges, each naming the field and value (s33
mutation run on `transfer/worker_config.py`: each case passed every older test)."""

from __future__ import annotations

import pytest

from kvtier.transfer import WorkerConfig
from kvtier.transfer.worker_config import MAX_IO_BYTES


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"disk_num_slots": -1}, r"WorkerConfig.disk_num_slots must be a non-negative int, got -1"),
        ({"disk_num_slots": True}, r"WorkerConfig.disk_num_slots must be .* got True"),
        ({"disk_num_slots": "4"}, r"WorkerConfig.disk_num_slots must be .* got '4'"),
        ({"disk_batch_bytes": 0}, r"disk_buffer_slots and disk_batch_bytes must be positive"),
        ({"disk_batch_bytes": MAX_IO_BYTES + 1}, rf"at most {MAX_IO_BYTES} .*{MAX_IO_BYTES + 1}"),
        ({"copy_threads": True}, r"copy_threads must be None or a positive int, got True"),
        ({"disk_fingerprint": "model-\udc80"}, r"disk_fingerprint is not valid text"),
    ],
)
def test_a_bad_value_is_refused_naming_it(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kwargs)  # type: ignore[arg-type]


def test_the_largest_batch_one_io_call_moves_is_accepted() -> None:
    assert WorkerConfig(disk_batch_bytes=MAX_IO_BYTES).disk_batch_bytes == MAX_IO_BYTES


def test_a_config_without_a_disk_path_has_no_slot_file() -> None:
    """Asking a diskless config for its files is a ValueError, not a TypeError from
    `os.path.join(None, ...)`."""
    with pytest.raises(ValueError, match="WorkerConfig has no disk_path"):
        WorkerConfig(cpu_num_slots=4).disk_file()
    with pytest.raises(ValueError, match="WorkerConfig has no disk_path"):
        WorkerConfig(cpu_num_slots=4).disk_manifest_file()
