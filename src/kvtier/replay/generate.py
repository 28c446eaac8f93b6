"""A second workload: multi-turn chat behind shared system prompts, as a Mooncake trace.

Conversations arrive as a Poisson process. Each picks one of `num_system_prompts`
system prompts (Zipf popularity) and runs a geometric number of turns. Turn k's prompt
is the system prompt, then every earlier user message and answer of the conversation,
then the new user message; its answer arrives after `output_length / decode_tokens_per_s`
and the next turn after an exponential think time. Message and answer lengths are
lognormal. Hash ids are chained exactly like prompt-prefix hashes: block b's id is
determined by block b-1's id and the content (segment, offsets) of block b, so two
prompts share ids exactly as long as they share a token prefix; a partial last block
gets its own id.

The defaults give about 4,500 requests, 142 k block references and 21 k distinct
512-token blocks (an infinite cache hits 86.5 % of prompt tokens); conversations overlap
enough that LRU needs ~5 M tokens to come close to that, so 100 k ... 30 M is an
informative sweep, like the Mooncake trace's.

Run: `kvtier generate OUT.jsonl [--seed N] [--conversations N]` (or
`python -m kvtier.replay.generate ...`, the same command).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from kvtier.core.plural import counted
from kvtier.replay.ascii_number import ascii_int
from kvtier.replay.command import BROKEN_PIPE_STATUS
from kvtier.replay.option_types import attach_dashed_values
from kvtier.replay.outputs import check_file_path, json_output_path, shell_word
from kvtier.replay.signals import raise_if_terminated, sigterm_unwinds
from kvtier.replay.stdout_lines import progress_bar_disable
from kvtier.replay.store_once import StoreOnce
from kvtier.replay.trace import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, TraceRecord, write_trace
from kvtier.replay.whole_file import descriptor_of

Segment = tuple[int, int]  # (segment id, length in tokens)

# The ranges of the command's options (`check_options`). At the default workload a
# conversation's prompts hold about 121 k tokens (4,485 requests, 141,580 blocks of 512
# for 600 conversations) and a block reference costs ~40 bytes of memory while the trace is
# built and ~2 us to make (measured, s27: --block-size 1 at the default 600 conversations
# makes 71.3 M references in 141 s on a shared 2-core machine, 3.0 GiB peak, plus 8 s to
# write; s28: gzip writes 8.5 M references in 17 s, as long as making them took; the
# progress bars count the requests as they are made, then as they are written).
MAX_SEED = (1 << 64) - 1
MAX_CONVERSATIONS = 100_000  # ~750 k requests, ~24 M block references at 512 tokens
TOKENS_PER_CONVERSATION = 121_000
MAX_BLOCK_REFERENCES = 100_000_000  # about 4 GiB of memory and 3-4 minutes at the bound
# Each option's accepted range, checked by `check_options` and stated in its help.
OPTION_RANGES = {
    "--seed": (0, MAX_SEED),
    "--conversations": (1, MAX_CONVERSATIONS),
    "--block-size": (1, MAX_BLOCK_SIZE),
}


class ProgressBar(Protocol):
    """What `generate_chat_trace` reports its progress to (a `tqdm` bar is one)."""

    total: float | None

    def update(self, n: float | None = 1) -> bool | None: ...


@dataclass(frozen=True)
class ChatWorkloadConfig:
    """Parameters of the chat workload (times in seconds, lengths in tokens)."""

    seed: int = 0
    num_conversations: int = 600
    arrival_rate_per_s: float = 1.0  # conversations started per second
    num_system_prompts: int = 20
    system_prompt_tokens: tuple[int, int] = (1000, 6000)  # uniform range
    system_prompt_zipf: float = 1.1  # popularity of system prompt i ∝ 1 / (i+1)^s
    mean_turns: float = 8.0  # geometric, at least 1
    max_turns: int = 20
    user_tokens_median: int = 1000  # chat messages with pasted context
    answer_tokens_median: int = 400
    length_sigma: float = 0.8  # of the lognormal message and answer lengths
    think_time_mean_s: float = 120.0
    decode_tokens_per_s: float = 50.0
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        # The range `--seed` allows: `random.Random` seeds a negative seed with its
        # absolute value, so -3 would silently give the trace of seed 3.
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be 0 ... {MAX_SEED}, got {self.seed}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                if not (0 < value[0] <= value[1]):
                    raise ValueError(f"{f.name} must be a range 0 < lo <= hi, got {value!r}")
            elif f.name != "seed" and not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value!r}")


class _ChainedIds:
    """Interns (parent id, block content) to sequential ids: a chained prefix hash."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def hash_ids(self, segments: Sequence[Segment], block_size: int) -> tuple[int, ...]:
        pieces: list[tuple[int, int, int]] = []
        out: list[int] = []
        parent = -1
        used = 0
        for seg_id, length in segments:
            offset = 0
            while offset < length:
                take = min(length - offset, block_size - used)
                pieces.append((seg_id, offset, offset + take))
                offset += take
                used += take
                if used == block_size:
                    parent = self._intern(parent, pieces)
                    out.append(parent)
                    pieces, used = [], 0
        if pieces:
            out.append(self._intern(parent, pieces))
        return tuple(out)

    def _intern(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        content = (parent, tuple(pieces))
        found = self._ids.get(content)
        if found is None:
            found = self._ids[content] = len(self._ids)
        return found


def _lognormal(rng: random.Random, median: int, sigma: float) -> int:
    return max(1, round(median * math.exp(rng.gauss(0.0, sigma))))


def generate_chat_trace(
    config: ChatWorkloadConfig, progress: ProgressBar | None = None
) -> list[TraceRecord]:
    """Return the workload's requests in arrival order (deterministic for a seed).

    `progress` is given the number of requests as its total, then one update per request
    (small blocks make long prompts slow to hash: 8 s at 1-token blocks).
    """
    rng = random.Random(config.seed)
    lo, hi = config.system_prompt_tokens
    systems = [rng.randint(lo, hi) for _ in range(config.num_system_prompts)]
    weights = [1 / (i + 1) ** config.system_prompt_zipf for i in range(len(systems))]
    next_segment = len(systems)
    p_more = 1 - 1 / config.mean_turns
    events: list[tuple[float, int, int, list[Segment]]] = []  # (time, conv, turns left, history)
    start = 0.0
    for conv in range(config.num_conversations):
        start += rng.expovariate(config.arrival_rate_per_s)
        turns = 1
        while turns < config.max_turns and rng.random() < p_more:
            turns += 1
        system = rng.choices(range(len(systems)), weights)[0]
        heapq.heappush(events, (start, conv, turns, [(system, systems[system])]))
    ids = _ChainedIds()
    records: list[TraceRecord] = []
    if progress is not None:
        progress.total = sum(turns for _, _, turns, _ in events)
    while events:
        time_s, conv, turns_left, history = heapq.heappop(events)
        user = (next_segment, _lognormal(rng, config.user_tokens_median, config.length_sigma))
        answer_len = _lognormal(rng, config.answer_tokens_median, config.length_sigma)
        answer = (next_segment + 1, answer_len)
        next_segment += 2
        prompt = [*history, user]
        input_length = sum(length for _, length in prompt)
        records.append(
            TraceRecord(
                timestamp_ms=round(time_s * 1000),
                input_length=input_length,
                output_length=answer_len,
                hash_ids=ids.hash_ids(prompt, config.block_size),
            )
        )
        if progress is not None:
            progress.update(1)
        if turns_left > 1:
            done = time_s + answer_len / config.decode_tokens_per_s
            think = rng.expovariate(1 / config.think_time_mean_s)
            heapq.heappush(events, (done + think, conv, turns_left - 1, [*prompt, answer]))
    return records


DESCRIPTION = (
    "Write a multi-turn chat workload (shared system prompts) as a Mooncake-format trace"
    " for `kvtier replay`."
)


def build_parser() -> argparse.ArgumentParser:
    """Return the generator's argument parser (`python -m kvtier.replay.generate`)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.replay.generate", description=DESCRIPTION
    )
    configure(parser)
    return parser


def add_parser(subparsers: Any) -> None:
    """Register `kvtier generate`: the same options and checks as the module form."""
    parser = subparsers.add_parser(
        "generate",
        help="write a multi-turn chat workload trace (shared system prompts) for replay",
        description=DESCRIPTION,
    )
    configure(parser)
    parser.set_defaults(run=lambda args: write(args, parser), command="generate")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the generator's options to `parser`."""
    defaults = ChatWorkloadConfig()
    # `-` is stdout, as `kvtier replay`'s trace `-` is stdin: `generate - | replay -`.
    parser.add_argument(
        "out", type=json_output_path, help="output .jsonl path (.gz: gzipped); - writes to stdout"
    )
    parser.add_argument(
        "--seed",
        action=StoreOnce,
        type=ascii_int,
        default=defaults.seed,
        help=f"random seed, {_range('--seed')} (default {defaults.seed})",
    )
    parser.add_argument(
        "--conversations",
        action=StoreOnce,
        type=ascii_int,
        default=defaults.num_conversations,
        help=f"number of conversations, {_range('--conversations')} (default "
        f"{defaults.num_conversations}); each makes about {TOKENS_PER_CONVERSATION:,} "
        f"tokens of prompts, and the trace may hold at most {MAX_BLOCK_REFERENCES:,} "
        "block references (conversations x tokens / block size)",
    )
    parser.add_argument(
        "--block-size",
        action=StoreOnce,
        type=ascii_int,
        default=defaults.block_size,
        help=f"tokens per hash block, {_range('--block-size')} (default {defaults.block_size})",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Write a chat workload trace; return the exit status (130 after Ctrl-C, 143 after
    SIGTERM, with no partial file left behind; 141, quietly, when OUT's reader left)."""
    parser = build_parser()
    args = parser.parse_args(attach_dashed_values(sys.argv[1:] if argv is None else argv))
    return write(args, parser)


def write(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the parsed options, generate the trace and write it; return the exit status.

    A bad option ends in `parser.error` (status 2), naming the option and its value.
    """
    try:
        check_options(args)
    except ValueError as exc:  # named as the option, not as the config field it sets
        parser.error(str(exc))
    try:
        config = ChatWorkloadConfig(
            seed=args.seed, num_conversations=args.conversations, block_size=args.block_size
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        with sigterm_unwinds():
            check_file_path("out", args.out)  # before the work, not after it
            records = _generate_with_progress(config)
            raise_if_terminated()  # one a finalizer swallowed: before any file is written
            _write_with_progress(args.out, records)
            raise_if_terminated()  # in the block: it forgets the request as it ends
    except KeyboardInterrupt:
        print(f"\n{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # ReplayError: OUT cannot be written
        parser.error(str(exc))
    except BrokenPipeError:  # OUT's reader left (`generate - | head -1`): quietly, as kvtier does
        return BROKEN_PIPE_STATUS
    except OSError as exc:  # the disk filled up, or the folder changed since the check
        parser.error(f"cannot write {args.out}: {exc.strerror or exc}")
    # The trace itself may be going to stdout (`generate /dev/stdout | kvtier replay ...`).
    report = sys.stderr if descriptor_of(args.out) == 1 else sys.stdout
    if report is not None:  # None: closed (`2>&-`), and print() would fall back on stdout
        with contextlib.suppress(BrokenPipeError):
            wrote = f"wrote {counted(len(records), 'request')} to {shell_word(args.out)}"
            print(wrote, file=report)
    return 0


def check_options(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option out of its range, before any work.

    Without a cap, `--conversations 10**12` allocated and ran until memory ran out; a
    negative `--seed` gave the trace of its absolute value (`random.Random`), so two
    seeds gave one trace.
    """
    for option, (least, most) in OPTION_RANGES.items():
        value = getattr(args, option[2:].replace("-", "_"))
        if not least <= value <= most:
            raise ValueError(f"argument {option}: must be {least} ... {most}, got {value}")
    refs = args.conversations * TOKENS_PER_CONVERSATION // args.block_size
    if refs > MAX_BLOCK_REFERENCES:
        raise ValueError(
            f"--conversations={args.conversations} at --block-size={args.block_size} is about"
            f" {refs:,} block references; the generator makes at most"
            f" {MAX_BLOCK_REFERENCES:,}: give fewer conversations or a larger block size"
        )


def _range(option: str) -> str:
    """Return the range `option` accepts, as its help states it."""
    least, most = OPTION_RANGES[option]
    return f"{least} ... {'2**64-1' if most == MAX_SEED else f'{most:,}'}"


def _generate_with_progress(config: ChatWorkloadConfig) -> list[TraceRecord]:
    """`generate_chat_trace` with a progress bar on a terminal (none off one)."""
    from tqdm import tqdm

    with tqdm(unit="req", desc="generating", leave=False, disable=progress_bar_disable()) as bar:
        return generate_chat_trace(config, bar)


def _write_with_progress(path: str, records: list[TraceRecord]) -> None:
    """`write_trace` with a progress bar on a terminal (none off one): gzipping 8.5 M
    block references takes as long as making them (17 s)."""
    from tqdm import tqdm

    disable = progress_bar_disable()
    with tqdm(records, unit="req", desc="writing", leave=False, disable=disable) as bar:
        write_trace(path, bar)


if __name__ == "__main__":
    sys.exit(main())
