"""One engine step's forward pass: the batch its scheduled work reads and writes, and the
tokens sampled for the requests whose computed tokens reach their end."""

from __future__ import annotations

import torch

from kvtier.engine.runner import BatchInput, ModelRunner, SequenceInput
from kvtier.engine.sampling import sample
from kvtier.engine.scheduler_step import SchedulerStep


def run_forward(runner: ModelRunner, step: SchedulerStep) -> tuple[list[int | None], torch.Tensor]:
    """Run `step.work` through `runner`; return a token per work entry and the logits.

    A work entry's token is None when its chunk stops short of the request's tokens (a
    prefill chunk): nothing is sampled for it. The logits have one row per work entry.
    """
    sequences = []
    for work in step.work:
        request = work.request
        start = request.num_computed_tokens
        tokens = request.token_ids[start : start + work.num_new_tokens]
        tables = tuple(tuple(t) for t in request.block_tables)
        sequences.append(SequenceInput(tuple(tokens), start, tables))
    logits = runner.run(BatchInput(tuple(sequences)))
    rows = []
    for index, work in enumerate(step.work):
        request = work.request
        if request.num_computed_tokens + work.num_new_tokens == request.num_tokens:
            rows.append(index)
    sampled_rows = sample(
        logits[rows],
        [step.work[i].request.params for i in rows],
        [step.work[i].request.generator for i in rows],
    )
    by_row = dict(zip(rows, sampled_rows, strict=True))
    return [by_row.get(index) for index in range(len(step.work))], logits
