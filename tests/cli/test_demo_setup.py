"""Each of `kvtier demo`'s options reaches the workload or the run it sizes.

Found by a mutation run (s29): the CPU+disk run could drop --cascade or --disk-io (and
so run write_through, or direct I/O, whatever was asked) with every test passing.
"""

from __future__ import annotations

from test_demo_options import demo_parser

from kvtier.cli.demo import MIB, _setup
from kvtier.engine.chat_workload import ChatWorkload
from kvtier.offload.config import CascadeMode, DiskIOMode, OffloadConfig

OPTIONS = (
    "--conversations 3 --turns 5 --system-tokens 7 --document-tokens 11 --user-tokens 13"
    " --answer-tokens 17 --cpu-mib 19 --disk-mib 23 --cascade-cpu-mib 2 --cascade write_back"
    " --disk-io page_cache"
)


def test_every_option_reaches_the_workload_and_each_run() -> None:
    workload, configs = _setup(demo_parser().parse_args(OPTIONS.split()), 4096, "/tier")
    assert workload == ChatWorkload(3, 5, 7, 11, 13, 17, vocab_size=1024)
    page_cache = DiskIOMode.PAGE_CACHE
    assert configs == [
        ("offload off", None),
        ("CPU tier", OffloadConfig(cpu_bytes=19 * MIB)),
        (
            "disk tier",
            OffloadConfig(disk_bytes=23 * MIB, disk_path="/tier", disk_io_mode=page_cache),
        ),
        (
            "CPU+disk",
            OffloadConfig(
                cpu_bytes=2 * MIB,
                disk_bytes=23 * MIB,
                disk_path="/tier",
                disk_io_mode=page_cache,
                cascade=CascadeMode.WRITE_BACK,
            ),
        ),
    ]


def test_prompt_ids_stay_below_a_small_vocab() -> None:
    workload, _ = _setup(demo_parser().parse_args([]), 100, "/tier")
    assert workload.vocab_size == 100
