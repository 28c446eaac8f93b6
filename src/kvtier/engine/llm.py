"""The reference engine's public API: `LLM(model=..., kv_offload=...).generate(...)`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from kvtier.core.block_pool import BlockPool
from kvtier.core.hashing import BlockHasher, RequestHasher
from kvtier.core.plural import counted
from kvtier.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvtier.engine.fingerprint import kv_fingerprint
from kvtier.engine.forward import keep_sampled, run_forward
from kvtier.engine.generation_defaults import default_sampling_params
from kvtier.engine.model import build_model
from kvtier.engine.offload_side import OffloadSide, layout_of
from kvtier.engine.outputs import EngineStats, RequestOutput, output_of
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Scheduler, SchedulerLimits, SchedulerStep
from kvtier.engine.stall_checks import StallChecks
from kvtier.engine.validation import (
    RequestLimits,
    TokenPrompt,
    as_params_list,
    as_prompt,
    as_prompt_list,
    as_session_list,
    check_arguments,
    check_request,
    one_spelling,
    progress_bar_maker,
)
from kvtier.engine.weights import load_model
from kvtier.offload.config import OffloadConfig
from kvtier.offload.host import remove_created_directory

_IDLE_WAIT_S = 0.0005  # nothing to compute: let transfers progress


class LLM(StallChecks):
    """A small paged-attention engine with kvtier's offloading, for CPU or CUDA.

    `model` is a local HF-format checkpoint directory, a `ModelConfig` (random weights
    with `engine.seed`), or None for `ModelConfig.tiny()`. Nothing is ever downloaded.
    `engine.seed` also seeds the temperature sampling of requests without
    `SamplingParams.seed`, in the order they are queued (not torch's global RNG): two
    engines with the same seed given the same calls sample the same tokens.
    After `shutdown()` (or leaving a `with` block) the engine refuses new work. The
    stall checks of `step`, and `drain`, come from `StallChecks`.
    """

    def __init__(
        self,
        model: str | Path | ModelConfig | None = None,
        kv_offload: OffloadConfig | None = None,
        engine: EngineConfig | None = None,
    ) -> None:
        check_arguments(model, kv_offload, engine)
        # Before anything is allocated; a directory it created goes if the start fails.
        created = None if kv_offload is None else kv_offload.prepare_host()
        try:
            self._start(model, kv_offload, engine or EngineConfig())
        except BaseException:
            remove_created_directory(created)
            raise

    def _start(
        self,
        model: str | Path | ModelConfig | None,
        kv_offload: OffloadConfig | None,
        engine: EngineConfig,
    ) -> None:
        self.engine_config = engine
        device = torch.device(engine.device)
        if isinstance(model, (str, Path)):
            network = load_model(model, device)
        else:
            network = build_model(model or ModelConfig.tiny(), device, seed=engine.seed)
        self.model_config = network.config
        self._default_params = default_sampling_params(model)
        cache = CacheConfig(block_size=engine.block_size, num_blocks=engine.num_gpu_blocks)
        self.runner = ModelRunner(network, cache)
        self.layout = layout_of(self.runner)
        self.pool = BlockPool(engine.num_gpu_blocks)
        if kv_offload is None:
            self._hasher = BlockHasher(self.layout.hash_block_size)
            self.offload = None
        else:
            self._hasher = BlockHasher(
                self.layout.hash_block_size, kv_offload.hash_algo, kv_offload.hash_seed
            )
            fingerprint = ""  # what a persistent disk tier is reused by (nothing else)
            if kv_offload.disk_persist:
                fingerprint = kv_fingerprint(
                    model,
                    self.model_config,
                    engine.seed,
                    self.layout,
                    self._hasher,
                    torch.device(engine.device).type,
                )
            self.offload = OffloadSide(kv_offload, self.runner, self.pool, fingerprint)
        max_len = self.model_config.max_position  # vLLM's max_model_len: a request stops there
        self.scheduler = Scheduler(
            self.layout,
            self.pool,
            SchedulerLimits(engine.max_num_seqs, engine.max_num_batched_tokens, max_len),
            None if self.offload is None else self.offload.scheduler,
            self.model_config.eos_token_ids,
        )
        self.stats = EngineStats()
        self._limits = RequestLimits(
            self.model_config.vocab_size,
            self.model_config.max_position,
            self.layout,
            self.pool.num_usable_blocks,
            engine.max_logprobs,
        )
        self._next_id = 0
        # Seeds unseeded temperature requests (make_generator); torch's global RNG is unused.
        self._seed_source = torch.Generator().manual_seed(engine.seed)
        self._is_shut_down = False

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompts: Sequence[TokenPrompt] | Mapping[str, object],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        show_progress: bool | Callable[..., tqdm] | None = None,
        *,
        session_ids: Sequence[str | None] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` (a list of token id lists) to completion; outputs come in prompt
        order. Each prompt is taken as `add_request` takes one, so vLLM's `TokensPrompt`
        dicts may stand for lists; as in vLLM, one dict or one flat list of ints is one
        prompt. An array of prompts is refused, naming the `.tolist()` call to pass.

        `params` is one `SamplingParams` for all, one per prompt, or None (as vLLM:
        `get_default_sampling_params()`).
        `show_progress` shows a tqdm bar (None, the default: none, where vLLM shows one);
        a callable makes the bar, called as vLLM calls `use_tqdm`'s. vLLM's names for
        them, `sampling_params=` and `use_tqdm=`, are taken too; giving both names of one
        argument raises TypeError. `session_ids`, one per prompt, are carried as
        `add_request`'s `session_id` is.

        Every prompt is checked as in `add_request` before any is queued: one bad prompt
        rejects the whole call (the error names its index) and nothing runs. If a step
        fails anyway, this call's unfinished requests are aborted and their blocks freed
        before the error propagates, so the engine stays usable (and those the failed step
        finished are dropped with it). Requests queued by `add_request` that finish during
        the call are returned by the next `step`.
        """
        self._require_running()
        given = one_spelling("params", params, "sampling_params", sampling_params)
        show_bar = one_spelling("show_progress", show_progress, "use_tqdm", use_tqdm)
        make_bar = progress_bar_maker(show_bar)
        prompt_list = as_prompt_list(prompts)
        params_list = as_params_list(given, len(prompt_list), self._default_params)
        checked = [
            self._checked(prompt, sp, f"prompt {index}")
            for index, (prompt, sp) in enumerate(zip(prompt_list, params_list, strict=True))
        ]
        sessions = as_session_list(session_ids, len(checked))
        requests = [
            self._enqueue(*prompt, session)
            for prompt, session in zip(checked, sessions, strict=True)
        ]
        pending = {r.request_id for r in requests}
        others: list[Request] = []  # `add_request`'s, finished here: the next step returns them
        bar = None
        try:
            bar = make_bar(total=len(requests))  # a callable's own bar may fail: none runs
            while pending:
                for request in self.step():
                    if request.request_id in pending:
                        pending.discard(request.request_id)
                        bar.update(1)
                    else:
                        others.append(request)
        except BaseException:
            for request in requests:
                if request.request_id in pending:
                    self._abort(request)
            # Finished by the step that failed and never returned: this call owned them
            # and raises, so no later `step` returns them (nor keeps them for good).
            unreturned = self.scheduler.unreturned
            self.scheduler.unreturned = [r for r in unreturned if r.request_id not in pending]
            raise
        finally:
            self.scheduler.unreturned[:0] = others
            if bar is not None:
                bar.close()
        return [output_of(r, self.model_config) for r in requests]

    def get_default_sampling_params(self) -> SamplingParams:
        """Return `generate`'s params when given none (`generation_defaults`), as vLLM's."""
        return self._default_params

    def add_request(
        self, prompt: TokenPrompt, params: SamplingParams, *, session_id: str | None = None
    ) -> Request:
        """Queue one prompt; `step` runs it.

        `prompt` is a sequence of ints, a 1-D integer numpy array / torch tensor, or
        vLLM's `TokensPrompt` dict `{"prompt_token_ids": ids}` (its text `"prompt"` beside
        them is carried as `Request.prompt`, not tokenized; None or empty values count as
        absent, as in vLLM); any other key (`"cache_salt"`, ...) is refused by name.
        `session_id` (e.g. a conversation's id) is carried by the tier's stored-block
        events of this request's blocks, as vLLM's are. Raises TypeError for a prompt,
        params or session id of the wrong type, and ValueError for an empty prompt, token
        ids or stop token ids outside the vocab (as vLLM), a prompt of the model's
        `max_position` tokens or more (vLLM's max_model_len; a longer output is cut there,
        "length"), or one whose output would need more than the GPU pool; nothing queued.
        """
        self._require_running()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {params!r}")
        (session_id,) = as_session_list([session_id], 1)
        checked = self._checked(prompt, params, f"request req-{self._next_id}")
        return self._enqueue(*checked, session_id)

    def abort_request(self, request: Request) -> None:
        """Stop a request `add_request` returned: its GPU blocks are freed now, a load in
        flight for it is dropped when it finishes, and `step` never returns it (its
        `finish_reason` becomes ABORT). A finished request is left as is. Raises
        TypeError for what is not a Request, ValueError for another engine's request.
        """
        self._require_running()
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request from add_request, got {request!r}")
        if request.status is not RequestStatus.FINISHED and not self.scheduler.holds(request):
            raise ValueError(f"{request.request_id} is not a request of this engine")
        self._abort(request)

    def step(self) -> list[Request]:
        """Run one engine step (SPEC §2.2); return the requests that finished in it, and
        those an earlier step finished but did not return (cut short after finishing them).

        Raises RuntimeError when no step could ever run the first waiting request (it is
        aborted first). If handing the transfers to the worker, the forward pass or
        sampling fails (or is interrupted), the step's requests are aborted before the
        error propagates; transfers the worker never took are reported failed.
        """
        self._require_running()
        if self.offload is not None and self.offload.has_unapplied_outcome():
            self._apply_offload()  # an earlier step's, cut short: before anything is admitted
        step = self.scheduler.schedule()
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(step.preempted_ids - step.released_ids)
        self.stats.num_idle_releases += len(step.released_ids)
        self.stats.num_waits_for_frees += step.waits_for_frees
        if step.stuck is not None or self._is_stalled(step):
            head = step.stuck or self.scheduler.waiting[0]
            self._abort(head)
            raise RuntimeError(
                f"no progress possible: {head.request_id} ({counted(head.num_tokens, 'token')})"
                f" does not fit the GPU pool of {counted(self.pool.num_usable_blocks, 'block')}"
                f" of {counted(self.engine_config.block_size, 'token')}; it was aborted"
            )
        try:
            if self.offload is not None:
                # The plan only stores blocks computed by earlier steps and loads into
                # blocks no running request uses, so its copies may overlap the forward.
                self.offload.prepare(step)
                self.offload.submit()
            sampled = self._forward(step) if step.work else []
            # A request is kept until returned (`Scheduler.unreturned`) as it finishes: cut
            # short from there on, the next step returns it.
            self.scheduler.complete(step, sampled, time.perf_counter())
        except BaseException:
            for work in step.work:
                self._abort(work.request)
            raise
        self._count_finished()  # this step's, and a step's cut short after finishing some
        if self.offload is not None:
            if not step.work:  # before the poll: what finishes meanwhile is applied now
                time.sleep(_IDLE_WAIT_S)
            self.offload.poll()
            self._apply_offload()
        # Copied and emptied in one statement (one line): an interrupt lands before it.
        unreturned = self.scheduler.unreturned
        return (unreturned.copy(), unreturned.clear())[0]  # type: ignore[func-returns-value]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, in the GPU cache and in the lower tiers (SPEC §6.9),
        e.g. after the weights were updated in memory; nothing cached before is served.

        Returns False, dropping nothing, while a request is unfinished (finish or abort
        it first). Otherwise True, or False while transfers are outstanding (their slots
        come back as they are reported; nothing stored before is served either way). A
        persistent disk tier's manifest is emptied before this returns. An abort that an
        interrupt (Ctrl-C) cut short is ended first, as the next step would end it.
        """
        self._require_running()
        self.scheduler.end_aborts()  # cut short, a retry (or the next step) ends the rest
        if self.scheduler.has_unfinished():
            return False
        done = self.offload is None or self.offload.reset()
        self.pool.discard_all_keys()  # free blocks, and those finish-time stores still pin
        return done

    def shutdown(self) -> None:
        """Drain pending stores and stop the offload worker (idempotent).

        Afterwards `generate`, `add_request` and `step` raise RuntimeError. A drain that
        can never finish raises its RuntimeError; the worker is stopped all the same. An
        abort that an interrupt (Ctrl-C) cut short is ended first (its request finished,
        its blocks freed, its finish-time stores drained), as the next step would end it.
        """
        if self._is_shut_down:
            return
        try:
            self.scheduler.end_aborts()  # `drain` may run no step (no store pending)
            self.drain()
        finally:
            self._is_shut_down = True
            if self.offload is not None:
                self.offload.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals

    def _require_running(self) -> None:
        if self._is_shut_down:
            raise RuntimeError(
                "LLM is shut down (shutdown() was called or its `with` block ended); "
                "create a new LLM"
            )

    def _checked(
        self, prompt: object, params: SamplingParams, where: str
    ) -> tuple[list[int], str | None, SamplingParams]:
        token_ids, text = as_prompt(prompt, where)
        return token_ids, text, check_request(token_ids, params, self._limits, where)

    def _enqueue(
        self, token_ids: list[int], text: str | None, params: SamplingParams, session_id: str | None
    ) -> Request:
        request = Request(
            request_id=f"req-{self._next_id}",
            prompt_token_ids=token_ids,
            params=params,
            hasher=RequestHasher(self._hasher),
            generator=params.make_generator(self._seed_source),
            session_id=session_id,
            prompt=text,
        )
        self._next_id += 1
        self.stats.num_prompt_tokens += len(token_ids)
        self.scheduler.add(request)
        return request

    def _abort(self, request: Request) -> None:
        self.scheduler.abort(request)

    def _count_finished(self) -> None:
        """Count the hit tokens of the requests finished since the last call (`generate`'s
        and `add_request`'s alike) and tell the offload side they finished.

        Safe to cut short: the offload side's note is a set, and the counts and the list
        go in one statement, so each request counts once."""
        scheduler, stats = self.scheduler, self.stats
        done = scheduler.uncounted
        if self.offload is not None:
            self.offload.finish_step(done)
        stats.num_local_hit_tokens, stats.num_external_hit_tokens, scheduler.uncounted = (
            stats.num_local_hit_tokens + sum(r.num_local_tokens_total for r in done),
            stats.num_external_hit_tokens + sum(r.num_external_tokens_total for r in done),
            [],
        )

    def _apply_offload(self) -> None:
        """Apply the loads finished or failed that the offload side kept for the engine.

        Kept until all is applied: a Ctrl-C on the way leaves it to the next step, which
        applies it again (`Scheduler.apply_offload` ignores what it applied) first.
        """
        assert self.offload is not None
        self.scheduler.apply_offload(self.offload.unapplied_outcome())
        self.offload.outcome_applied()

    def _forward(self, step: SchedulerStep) -> list[int | None]:
        self.stats.num_computed_tokens += sum(work.num_new_tokens for work in step.work)
        sampled, logits = run_forward(self.runner, step, self.model_config.eos_token_ids)
        keep_sampled(step, sampled, logits, self.engine_config.keep_logits)
        return sampled
