"""Trace reading (errors name the line), writing, summaries and the chat generator."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from replay_helpers import BLOCK, doc_trace

from kvtier.replay import generate, trace
from kvtier.replay.generate import ChatWorkloadConfig, generate_chat_trace
from kvtier.replay.generate import main as generate_main
from kvtier.replay.tier_replay import trace_keys
from kvtier.replay.trace import (
    TraceError,
    TraceRecord,
    read_numbered_trace,
    read_trace,
    summarize,
    write_trace,
)
from kvtier.replay.trace_values import MAX_CHARS

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}


# A record whose timestamp is written as given. Regression: a bad value was shown as Python
# shows what json.loads made of it (True, None, inf, 100.0, {'a': [False]}).
AS_WRITTEN = '{{"timestamp": {}, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}}'


def write_lines(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], r"expected a JSON object, got \[1, 2\]$"),
        ({**GOOD, "hash_ids": None}, "hash_ids must be a list of ints >= 0, got null$"),
        ({**GOOD, "hash_ids": [1, 2.0]}, r"hash_ids\[1\] must be an int >= 0, got 2\.0"),
        ({**GOOD, "hash_ids": [-3, 2]}, r"hash_ids\[0\] must be an int >= 0, got -3"),
        ({**GOOD, "hash_ids": [1, "2"]}, r'hash_ids\[1\] must be an int >= 0, got "2"$'),
        ({**GOOD, "hash_ids": [True, 2]}, r"hash_ids\[0\] must be an int >= 0, got true$"),
        (AS_WRITTEN.format("1e400"), "timestamp must be an int >= 0, got 1e400$"),
        (AS_WRITTEN.format("1E2"), "timestamp must be an int >= 0, got 1E2$"),
        (AS_WRITTEN.format("NaN"), "timestamp must be an int >= 0, got NaN$"),
        (AS_WRITTEN.format('{"a": [false]}'), r'timestamp .*, got {"a": \[false\]}$'),
        ({k: v for k, v in GOOD.items() if k != "timestamp"}, "missing field"),
        ({**GOOD, "input_length": -1}, "input_length must be an int >= 0"),
        ({**GOOD, "hash_ids": [1, 2, 3]}, "3 hash_ids for input_length=1000, expected 2"),
        ({**GOOD, "timestamp": -5}, "timestamp must be an int"),
        ({**GOOD, "hash_ids": [1, 2**64]}, f"hash id {2**64} does not fit in 64 bits"),
        ({**GOOD, "hash_ids": [7, 7]}, "hash id 7 repeats within the record"),
        ("[" * 100_000, r"not valid JSON \(nested too deeply\)"),
        ('{"hash_ids": [' + "9" * 5000 + "]}", "not valid JSON"),
        (json.dumps(GOOD)[:-1] + ', "input_length": 600}', "field 'input_length' given twice"),
        ({**GOOD, "input_length": 10**24}, "expected 1953125000000000000000 at"),  # exact
    ],
)
def test_malformed_record_names_its_line(tmp_path: Path, bad: object, message: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", [GOOD, "", bad])
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{message}"):
        read_trace(path, 512)


@pytest.mark.parametrize("field", [None, "timestamp", "hash_ids"])
def test_a_bad_value_nested_as_deep_as_the_reader_reads_is_named(
    tmp_path: Path, field: str | None
) -> None:
    """Regression: naming the value decodes the line again, a call deeper than the
    reader's decode; at the deepest nesting the reader decodes that raised RecursionError
    (kvtier replay printed a traceback) instead of the TraceError naming the line."""

    def read(depth: int) -> str:
        """Read a line whose bad value is nested `depth` deep; return the error."""
        deep = "[" * depth + "]" * depth
        line = deep if field is None else json.dumps({**GOOD, field: 0})
        line = line.replace(f'"{field}": 0', f'"{field}": {deep}')
        with pytest.raises((TraceError, RecursionError)) as error:
            read_trace(write_lines(tmp_path / "t.jsonl", [line]), 512)
        return f"{error.type.__name__}: {error.value}"

    decoded, too_deep = 1, 100_000  # the reader decodes the first, not the second
    assert "nested too deeply" not in read(decoded)
    assert "nested too deeply" in read(too_deep)
    while too_deep - decoded > 1:
        middle = (decoded + too_deep) // 2
        if "nested too deeply" in read(middle):
            too_deep = middle
        else:
            decoded = middle
    for depth in range(decoded - 3, decoded + 1):
        assert read(depth).endswith("[" * MAX_CHARS + " ..."), (depth, read(depth)[:200])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[1, 2], [3, 2]], r"hash_ids\[1\] = 2 follows id 3, but it follows id 1 at line 1"),
        ([[1, 2], [2, 5]], r"hash_ids\[0\] = 2 starts the prompt, but it follows id 1 at line 1"),
        ([[1, 2], [0, 1]], r"hash_ids\[1\] = 1 follows id 0, but it starts the prompt at line 1"),
    ],
)
def test_hash_ids_that_are_not_chained_prefix_hashes_name_the_line(
    tmp_path: Path, rows: list[list[int]], message: str
) -> None:
    """Independent block hashes would replay as false prefix hits: an id has one parent."""
    path = write_lines(tmp_path / "t.jsonl", [{**GOOD, "hash_ids": ids} for ids in rows])
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: {message}; hash ids must be chained"):
        read_trace(path, 512)


def test_a_byte_order_mark_before_the_first_record_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    assert read_trace(path, 512) == [TraceRecord(0, 1000, 5, (1, 2))]
    path.write_bytes(path.read_bytes() * 2)  # a second mark is not at the file's start
    with pytest.raises(TraceError, match=r"t\.jsonl:2: not valid JSON"):
        read_trace(path, 512)


def test_timestamps_must_not_go_backwards(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{**GOOD, "timestamp": 10}, GOOD])
    with pytest.raises(TraceError, match=":2: timestamp 0 is before"):
        read_trace(path, 512)


def test_write_read_round_trip_and_summary(tmp_path: Path) -> None:
    records = [
        TraceRecord(0, 1024, 5, (1, 2)),
        TraceRecord(7, 1100, 6, (1, 2, 3)),
        TraceRecord(9, 600, 1, (1, 9)),
    ]
    write_trace(tmp_path / "t.jsonl", records)
    assert read_trace(tmp_path / "t.jsonl", 512) == records
    summary = summarize(records, 512)
    assert (summary.num_requests, summary.num_block_refs, summary.num_distinct_blocks) == (3, 7, 4)
    # hits: request 2 reuses 2 blocks (1024 tokens), request 3 one block (512 tokens)
    assert summary.infinite_token_hit_ratio == pytest.approx((1024 + 512) / 2724)
    assert records[1].block_tokens(2, 512) == 76


def test_chat_generator_is_deterministic_and_chains_prefixes() -> None:
    config = ChatWorkloadConfig(num_conversations=20, block_size=64)
    first, again = generate_chat_trace(config), generate_chat_trace(config)
    assert first == again
    assert [r.timestamp_ms for r in first] == sorted(r.timestamp_ms for r in first)
    parents: dict[int, tuple[int, ...]] = {}
    for record in first:
        ids = record.hash_ids
        assert len(ids) == -(-record.input_length // 64)
        for j, hash_id in enumerate(ids):  # an id determines its whole prefix (chaining)
            assert parents.setdefault(hash_id, ids[:j]) == ids[:j]
    all_ids = [h for r in first for h in r.hash_ids]
    assert len(set(all_ids)) < len(all_ids), "turns must share their conversation's prefix"
    assert generate_chat_trace(ChatWorkloadConfig(seed=1, num_conversations=20)) != first


class _CountingBar:
    total: float | None = None
    done = 0

    def update(self, n: float | None = 1) -> None:
        assert self.total is not None, "the total comes before the first update"
        self.done += int(n or 0)


def test_chat_generator_reports_its_progress_per_request() -> None:
    # Regression: at 1-token blocks the generator ran 8 s with no sign of progress.
    config = ChatWorkloadConfig(num_conversations=20, block_size=64)
    bar = _CountingBar()
    records = generate_chat_trace(config, bar)
    assert bar.total == bar.done == len(records)
    assert records == generate_chat_trace(config)  # the bar changes nothing


def test_chat_generator_validates_and_writes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mean_turns must be > 0"):
        ChatWorkloadConfig(mean_turns=0)
    with pytest.raises(ValueError, match="system_prompt_tokens must be a range"):
        ChatWorkloadConfig(system_prompt_tokens=(10, 5))
    # The range `--seed` takes: a negative seed gave the trace of its absolute value.
    for seed in (-3, generate.MAX_SEED + 1):
        with pytest.raises(
            ValueError, match=rf"^seed must be 0 \.\.\. {generate.MAX_SEED}, got {seed}$"
        ):
            ChatWorkloadConfig(seed=seed)
    assert ChatWorkloadConfig(seed=generate.MAX_SEED).seed == generate.MAX_SEED
    out = tmp_path / "chat.jsonl"
    assert generate_main([str(out), "--conversations", "5", "--seed", "3"]) == 0
    assert len(read_trace(out)) >= 5


@pytest.mark.parametrize("where", ["missing/chat.jsonl", "."])
def test_chat_generator_names_an_output_path_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    out = tmp_path / where
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(out), "--conversations", "2"])
    assert exit_info.value.code == 2
    assert f"error: out {out}: " in capsys.readouterr().err


@pytest.mark.parametrize("name", ["t.jsonl.gz", "T.JSONL.GZ", "t.jsonl.Gz"])
def test_a_trace_named_gz_is_written_compressed_and_reads_back(tmp_path: Path, name: str) -> None:
    """`generate chat.jsonl.gz` wrote plain text under a .gz name; so did `X.JSONL.GZ`
    (a case-sensitive suffix test), which replay reads either way (by content)."""
    records = doc_trace(seed=1, num_requests=5)
    packed, plain = tmp_path / name, tmp_path / "t.jsonl"
    write_trace(packed, records)
    write_trace(plain, records)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert read_trace(packed, BLOCK) == read_trace(plain, BLOCK) == records


def test_chat_generator_refuses_an_empty_output_path(capsys: pytest.CaptureFixture[str]) -> None:
    """It said `cannot write : Is a directory`, unlike every other command's output path."""
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["", "--conversations", "2"])
    assert exit_info.value.code == 2
    assert "argument out: expected a path, got an empty string" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "limits"),
    [
        ("--conversations", "0", "1 ... 100000"),
        ("--block-size", "-1", "1 ... 1048576"),
        ("--conversations", "1000000000000", "1 ... 100000"),  # ran until memory ran out
        ("--block-size", "1048577", "1 ... 1048576"),
        ("--seed", "-1", "0 ... 18446744073709551615"),  # was the trace of --seed 1
        ("--seed", str(1 << 64), "0 ... 18446744073709551615"),
    ],
)
def test_chat_generator_names_the_option_out_of_range(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    option: str,
    value: str,
    limits: str,
) -> None:
    """Refused before any work, named as the option (not as the config field it sets).

    Regression: --conversations had no cap (10**12 conversations were generated until
    memory ran out) and a negative --seed gave the trace of its absolute value."""
    monkeypatch.setattr(generate, "_generate_with_progress", _no_work)
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(tmp_path / "chat.jsonl"), option, value])
    assert exit_info.value.code == 2
    assert f"error: argument {option}: must be {limits}, got {value}\n" in capsys.readouterr().err
    assert not (tmp_path / "chat.jsonl").exists()


def test_chat_generator_caps_the_block_references_small_blocks_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each option in range, but 1-token blocks make ~121 k references per conversation."""
    monkeypatch.setattr(generate, "_generate_with_progress", _no_work)
    with pytest.raises(SystemExit) as exit_info:
        generate_main(
            [str(tmp_path / "chat.jsonl"), "--conversations", "1000", "--block-size", "1"]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--conversations=1000 at --block-size=1 is about 121,000,000 block references" in err
    assert not (tmp_path / "chat.jsonl").exists()


def test_chat_generator_help_states_each_option_range_and_default() -> None:
    """Regression: the help gave defaults only; the ranges showed up as errors."""
    text = " ".join(generate.build_parser().format_help().split())
    assert "random seed, 0 ... 2**64-1 (default 0)" in text
    assert "number of conversations, 1 ... 100,000 (default 600)" in text
    assert "at most 100,000,000 block references" in text
    assert "tokens per hash block, 1 ... 1,048,576 (default 512)" in text


def _no_work(config: object) -> object:
    pytest.fail(f"the generator started on {config}")


def test_largest_64_bit_hash_id_is_accepted_and_keyed(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{**GOOD, "hash_ids": [0, 2**64 - 1]}])
    records = read_trace(path, 512)
    assert len(trace_keys(records, 512)[0]) == 2


def test_non_utf8_line_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"timestamp": \xff}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:2: not UTF-8 text \(byte 0xff at column 15\)"):
        read_trace(path, 512)


def test_gzip_trace_is_read_as_is_and_a_truncated_one_names_the_file(tmp_path: Path) -> None:
    records = [TraceRecord(i, 1000, 5, (i, 1000 + i)) for i in range(200)]
    write_trace(tmp_path / "t.jsonl", records)
    packed = gzip.compress((tmp_path / "t.jsonl").read_bytes())
    (tmp_path / "t.jsonl.gz").write_bytes(packed)
    assert read_trace(tmp_path / "t.jsonl.gz", 512) == records
    (tmp_path / "cut.gz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(TraceError, match=r"cut\.gz:\d+: corrupt gzip data"):
        read_trace(tmp_path / "cut.gz", 512)
    # Two gzip members: the first, whole, holds line 1; the second is cut inside line 2,
    # which the error names (a mutant naming the last line read passed the check above).
    first, second = (tmp_path / "t.jsonl").read_bytes().splitlines(keepends=True)[:2]
    cut = gzip.compress(second)
    (tmp_path / "cut2.gz").write_bytes(gzip.compress(first) + cut[: len(cut) // 2])
    with pytest.raises(TraceError, match=r"cut2\.gz:2: corrupt gzip data"):
        read_trace(tmp_path / "cut2.gz", 512)


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="needs /dev/fd")
@pytest.mark.parametrize("packed", [False, True])
def test_a_trace_from_a_pipe_is_read_from_its_first_byte(tmp_path: Path, packed: bool) -> None:
    """`kvtier replay <(zcat t.jsonl.gz)` or /dev/stdin: a pipe can be read only once."""
    records = [TraceRecord(i, 1000, 5, (i, 1000 + i)) for i in range(200)]
    write_trace(tmp_path / "t.jsonl", records)
    data = (tmp_path / "t.jsonl").read_bytes()
    assert 8192 < len(data) < 65536  # past one read buffer, within the pipe's capacity
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, gzip.compress(data) if packed else data)
        os.close(write_end)
        assert read_trace(f"/dev/fd/{read_end}", 512) == records
    finally:
        os.close(read_end)


def test_numbered_trace_gives_each_record_its_file_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [GOOD, "", "  ", {**GOOD, "timestamp": 3}])
    assert [number for number, _ in read_numbered_trace(path, 512)] == [1, 4]


def test_a_line_without_end_is_an_error_after_max_line_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `kvtier replay /dev/zero` read without limit (and Ctrl-C waited for a
    newline that never came); now reading stops at MAX_LINE_BYTES."""
    monkeypatch.setattr(trace, "MAX_LINE_BYTES", 100)
    path = tmp_path / "t.jsonl"
    record = '{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}\n'
    path.write_text(record + "x" * 101)
    with pytest.raises(TraceError, match=r"t.jsonl:2: line longer than 100 bytes"):
        read_trace(path, block_size=10)
    path.write_text(record + "x" * 100)  # the longest line taken: read, then a bad record
    with pytest.raises(TraceError, match=r"t.jsonl:2: ") as error:
        read_trace(path, block_size=10)
    assert "longer" not in str(error.value)


def test_the_infinite_hit_ratio_counts_a_partial_last_block_by_its_tokens() -> None:
    """A reused 600-token prompt in 512-token blocks hits 600 tokens, not 2 x 512 (a
    mutation run found no test of a partial block's hit)."""
    records = [TraceRecord(0, 600, 1, (1, 2)), TraceRecord(1, 600, 1, (1, 2))]
    assert summarize(records, 512).infinite_token_hit_ratio == 0.5
