"""One engine step's forward pass: the batch its scheduled work reads and writes, the
tokens sampled for the requests whose computed tokens reach their end, and what is kept of
their logits (`keep_sampled`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.engine.runner import BatchInput, ModelRunner, SequenceInput
from kvtier.engine.sampling import Logprob, sample
from kvtier.engine.scheduler_step import SchedulerStep


def run_forward(
    runner: ModelRunner, step: SchedulerStep, eos_token_ids: Sequence[int] = ()
) -> tuple[list[int | None], torch.Tensor]:
    """Run `step.work` through `runner`; return a token per work entry and the logits.

    A work entry's token is None when its chunk stops short of the request's tokens (a
    prefill chunk): nothing is sampled for it. The logits have one row per work entry,
    raw (before penalties and `min_tokens`, which mask the model's `eos_token_ids`).
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
    requests = [step.work[i].request for i in rows]
    params = [request.params for request in requests]
    histories = None
    if any(param.adjusts_logits for param in params):
        histories = [(r.prompt_token_ids, r.output_token_ids) for r in requests]
    sampled_rows = sample(
        logits[rows],
        params,
        [request.generator for request in requests],
        histories,
        eos_token_ids,
    )
    by_row = dict(zip(rows, sampled_rows, strict=True))
    return [by_row.get(index) for index in range(len(step.work))], logits


def keep_sampled(
    step: SchedulerStep, sampled: list[int | None], logits: torch.Tensor, keep_logits: bool
) -> None:
    """Keep, on each request a token was sampled for, its logits row (with `keep_logits`)
    and, when its `params.logprobs` is set, the token's logprob and the top ones.

    As vLLM's: raw logprobs (the log-softmax of the logits, before temperature), the
    sampled token first with its rank in the vocab, then the `logprobs` most likely
    (-1: all) ranked 1, 2, ... in order, and the sampled tokens' logprobs summed in
    `cumulative_logprob`. A sampled token among the most likely keeps its place first
    but takes its rank there, as vLLM's dict of them does (the two ranks differ only
    where it ties with tokens ranked after it).
    """
    for index, work in enumerate(step.work):
        token, request = sampled[index], work.request
        num_top = request.params.logprobs
        if token is None or (num_top is None and not keep_logits):
            continue
        row = logits[index].detach().float().cpu()
        if keep_logits:
            request.kept_logits.append(row)
        if num_top is None:
            continue
        logprobs = torch.log_softmax(row, dim=-1)
        chosen = float(logprobs[token])
        # Its rank counts the tokens at least as likely, itself included, as vLLM's does.
        position = {token: Logprob(chosen, int((logprobs >= chosen).sum()))}
        top = logprobs.topk(len(logprobs) if num_top == -1 else num_top)
        for rank, (value, top_token) in enumerate(zip(top.values, top.indices, strict=True)):
            position[int(top_token)] = Logprob(float(value), rank + 1)
        request.sample_logprobs.append(position)
        request.cumulative_logprob += chosen
