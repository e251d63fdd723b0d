"""The engine core: ``schedule -> run -> postprocess``, one forward per ``step``.

It speaks token ids only. ``add_request`` validates and raises a typed error before anything
is allocated; ``abort_request`` and every other terminal path go through
``Scheduler.finish``, which frees KV exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.blocks.prefix_hash import CacheNamespace
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.engine.latency_log import LatencyLog
from baton_serve.workers.engine.model_runner import ModelRunner, kv_cache_block_bytes, sampling_requests
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.engine.request import Request, RequestGroup, RequestStatus, SampleResume
from baton_serve.workers.engine.scheduler import Scheduler, SchedulerOutput
from baton_serve.workers.engine.structured import StructuredOutputs
from baton_serve.workers.engine.swap import HostBlockPool
from baton_serve.workers.engine.validation import RequestLimits
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.kv.event_log import KVEventLog
from baton_serve.workers.kv.migration import KVMigration, MigrationMeta
from baton_serve.workers.model.llama import LlamaForCausalLM
from baton_serve.workers.parallel.executor import TPExecutor
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.sampling.sampler import Sampler, SamplingRow


class EngineCore:
    """Continuous-batching engine over one model and one paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int,
                 eos_token_ids: Sequence[int], namespace: CacheNamespace | None = None,
                 device: torch.device | str = "cpu", tokenizer_json: str | None = None, *,
                 clock: Callable[[], float] = time.monotonic, timer: Callable[[], float] = time.perf_counter,
                 tensor_parallel: TPExecutor | None = None) -> None:
        """``clock``: the time arrivals, first tokens and ends are stamped with; ``timer``: what a
        step's duration is measured on (the simulator gives both its virtual clock);
        ``tensor_parallel``: the other ranks of this replica (``model`` is rank 0's shard)."""
        self.model = model
        self.tensor_parallel = tensor_parallel
        host_blocks = self._host_blocks(model, config)
        self.runner = ModelRunner(model, num_blocks, config.block_size, device, num_host_blocks=host_blocks,
                                  shared=config.kv_cache_shared,
                                  plan_sink=tensor_parallel.send_plan if tensor_parallel else None)
        if tensor_parallel is not None:
            tensor_parallel.setup_runner(num_blocks, config.block_size, host_blocks)
        self.sampler = Sampler()
        host_pool = HostBlockPool(self.runner.host_cache.shape[2]) if self.runner.host_cache is not None else None
        self._setup(config, num_blocks, eos_token_ids, model.cfg.vocab_size,
                    config.max_model_len or model.cfg.max_position_embeddings, namespace, tokenizer_json,
                    clock, timer, host_pool)
        self._forward = self._model_forward
        self._sample = self._model_sample

    @classmethod
    def for_simulation(cls, config: EngineConfig, num_blocks: int, eos_token_ids: Sequence[int], vocab_size: int,
                       max_model_len: int, forward: Callable[[SchedulerOutput], None], token_id: int,
                       namespace: CacheNamespace | None = None, clock: Callable[[], float] = time.monotonic,
                       timer: Callable[[], float] = time.perf_counter) -> EngineCore:
        """An engine without a model, for the simulator (``cluster.sim``): the same scheduling, KV
        blocks, prefix cache, bookkeeping and stop checks, with the forward pass replaced by
        ``forward(out)`` (which advances ``timer`` by the step's time) and every sampled token
        ``token_id``. Requests with a grammar are refused (no tokenizer); swap space is not kept."""
        core = cls.__new__(cls)
        core.model = None
        core.tensor_parallel = None
        core.runner = None
        core.sampler = None
        core._setup(config, num_blocks, eos_token_ids, vocab_size, config.max_model_len or max_model_len, namespace,
                    None, clock, timer, None)

        def sample(row_reqs: list[Request], repeat: list[int], logits: Any) -> tuple[list[int], list[float], Any, Any]:
            return [token_id] * len(row_reqs), [0.0] * len(row_reqs), None, None

        core._forward = forward
        core._sample = sample
        return core

    def _setup(self, config: EngineConfig, num_blocks: int, eos_token_ids: Sequence[int], vocab_size: int,
               max_model_len: int, namespace: CacheNamespace | None, tokenizer_json: str | None,
               clock: Callable[[], float], timer: Callable[[], float], host_pool: HostBlockPool | None) -> None:
        self.config = config
        self.clock, self.timer = clock, timer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.structured = StructuredOutputs(tokenizer_json, self.vocab_size, sorted(self.eos_token_ids))
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, num_blocks, config.block_size)
        self.kv_events = KVEventLog()  # what routers mirror of this engine's prefix cache
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching,
                                          namespace=namespace, event_sink=self.kv_events)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, host_pool, clock=clock)
        self.groups: dict[str, RequestGroup] = {}
        self._members: dict[str, Request] = {}
        self.migration = KVMigration(self)  # KV held for shipping (parked) or being received (incoming)
        self.paused: dict[str, Request] = {}  # descheduled for a slow reader, KV kept
        # Totals since start: how busy the engine is and on what (metrics, pool-ratio planning).
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.num_prefill_tokens_computed = 0
        self.num_decode_tokens_computed = 0
        self.prefill_seconds = 0.0  # step time attributed to prefill tokens (routers' prefill rate)
        self.num_prefill_steps = 0  # steps with prefill tokens (a mixed step counts in both)
        self.num_decode_steps = 0
        self.pending_prefill_tokens = 0  # prompt positions still to compute, as of the last step
        # Per step of t seconds with P prompt and D decode tokens, summed: n, P, D, PP, PD, DD, t, tP,
        # tD. Routers fit t = overhead + b P + c D to the steps themselves (router.routing.rates.StepFit).
        self.step_moments = [0.0] * 9
        self.latency = LatencyLog()  # each request's TTFT and TPOT here, for the rebalancer

    @staticmethod
    def _host_blocks(model: LlamaForCausalLM, config: EngineConfig) -> int:
        if config.scheduler.preemption_mode != "swap":
            return 0
        dtype = model.dtype
        return int(config.swap_space_gib * (1 << 30)) // kv_cache_block_bytes(model, config.block_size, dtype)

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel replica (idempotent; nothing to do otherwise)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None, prefill_only: bool = False, tenant: str = "",
                    resume: SampleResume | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (nothing allocated) when it cannot run.

        ``prefill_only`` parks the request with its KV after the first token (disaggregated prefill).
        ``tenant`` is who it shares its priority class with under the ``fair`` policy.
        ``resume`` continues one sample another worker was running (request migration).
        """
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.validate(prompt_token_ids, params)
        if resume is not None:
            resume.check(params, len(prompt_token_ids), self.max_model_len)
        emitted = list(resume.output_token_ids) if resume is not None else []
        # InvalidRequestError (nothing queued) if it does not compile; a resumed sample's grammar
        # state is rebuilt from the tokens it emitted.
        matcher = self.structured.matcher(params, emitted)
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt_token_ids) + params.max_tokens)
        member_id = request_id if params.n == 1 else f"{request_id}#0"
        req = Request(member_id, list(prompt_token_ids), params, max_total,
                      arrival_time=arrival_time or self.clock(), priority=priority,
                      cache_salt=cache_salt, parent_id=request_id, fork_pending=params.n - 1,
                      prefill_only=prefill_only, tenant=tenant,
                      index=resume.index if resume is not None else 0)
        if resume is not None:
            # Like a sample preempted by recompute: its tokens so far are re-prefilled with the
            # prompt, and its generator is where the first worker's was when it sampled them.
            for tok in emitted:
                req.append_token(tok)
            resume.advance(req.generator)
        req.matcher = matcher
        self.groups[request_id] = RequestGroup(request_id, [member_id], len(prompt_token_ids))
        self._members[member_id] = req
        self.scheduler.add_request(req)
        self.pending_prefill_tokens += req.num_tokens

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Every check that needs the model; raises InvalidRequestError with the OpenAI param name."""
        self.limits.validate(prompt_token_ids, params)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[TokenDelta]:
        """Finish the given client requests as aborted; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        deltas = []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            for mid in list(group.member_ids):
                req = self._members.get(mid)
                if req is not None:
                    req.fork_pending = 0
                    deltas.append(self._finish(req, RequestStatus.FINISHED_ABORTED, []))
        return deltas

    def pause_request(self, request_id: str) -> int:
        """Deschedule a client request's running samples (its reader is slow); KV stays allocated.

        This frees compute, not memory (seed 000 §4.4); ``resume_request`` puts them back.
        """
        group = self.groups.get(request_id)
        count = 0
        for mid in group.member_ids if group else ():
            req = self._members.get(mid)
            if req is not None and req.status == RequestStatus.RUNNING and mid not in self.migration.parked:
                self.scheduler.detach(req)
                self.paused[mid] = req
                count += 1
        return count

    def resume_request(self, request_id: str) -> int:
        group = self.groups.get(request_id)
        count = 0
        for mid in group.member_ids if group else ():
            req = self.paused.pop(mid, None)
            if req is not None:
                self.scheduler.admit_running(req)
                count += 1
        return count

    def has_unfinished_requests(self) -> bool:
        """True while some request is waiting or running (parked KV does not count)."""
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ------------------------------------------------------------------ the step
    def step(self) -> list[TokenDelta]:
        """Schedule, run one forward, sample, apply stop conditions. Returns this step's deltas."""
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.runner is not None:
                self.runner.apply_swaps(out)  # a tick may only swap out; the copies cannot wait
            return []
        started = self.timer()
        try:
            return self._run_step(out)
        finally:
            elapsed = self.timer() - started
            prefill_tokens = out.num_batched_tokens - len(out.decodes)
            self.num_steps += 1
            self.busy_seconds += elapsed
            self.num_decode_tokens_computed += len(out.decodes)
            self.num_prefill_tokens_computed += prefill_tokens
            self.num_prefill_steps += bool(prefill_tokens)
            self.num_decode_steps += bool(out.decodes)
            if prefill_tokens:
                # A mixed step's time is split by token share: a decode token costs about what a
                # prefill token does in the matmuls, which dominate on every device we serve on.
                self.prefill_seconds += elapsed * prefill_tokens / out.num_batched_tokens
            m, p, d = self.step_moments, float(prefill_tokens), float(len(out.decodes))
            m[0] += 1.0
            m[1] += p
            m[2] += d
            m[3] += p * p
            m[4] += p * d
            m[5] += d * d
            m[6] += elapsed
            m[7] += elapsed * p
            m[8] += elapsed * d
            self._count_pending_prefill()

    def _count_pending_prefill(self) -> None:
        # Counted here, on the engine thread, so stats() readers on other threads never walk queues
        # that are changing under them.
        pending = 0
        for req in (*self.scheduler.waiting, *self.scheduler.running):
            if req.num_computed_tokens < req.num_prompt_tokens:
                pending += req.num_prompt_tokens - max(req.num_computed_tokens, 0)
        self.pending_prefill_tokens = pending

    def _run_step(self, out: SchedulerOutput) -> list[TokenDelta]:
        sampling = [s.request for s in sampling_requests(out)]
        logits = self._forward(out)
        self.scheduler.update_after_forward(out)
        if not sampling:
            return []
        now = self.clock()
        row_reqs, repeat = self._expand_forks(sampling)
        token_ids, logprobs, top_ids, top_vals = self._sample(row_reqs, repeat, logits)
        deltas = []
        for i, req in enumerate(row_reqs):
            tok = token_ids[i]
            req.append_token(tok)
            refused = req.matcher is not None and not req.matcher.accept(tok)
            if refused:  # the mask should make this impossible: end the sample, say why
                req.stop_reason = f"token {tok} does not follow the grammar {req.matcher.error()}".strip()
            if req.first_token_time is None:
                req.first_token_time = now
                if req.num_output_tokens == 1:  # its very first token (not one resumed or received)
                    self.latency.add("ttft", now - req.arrival_time, req.num_prompt_tokens,
                                     max(req.num_cached_tokens, 0), 1)
            delta = TokenDelta(req.parent_id or req.request_id, req.index, [tok],
                               num_prompt_tokens=req.num_prompt_tokens,
                               num_cached_tokens=max(req.num_cached_tokens, 0), position=req.num_output_tokens - 1)
            if req.params.logprobs is not None:
                delta.logprobs = [logprobs[i]]
                if top_ids is not None and req.params.logprobs:
                    k = req.params.logprobs
                    delta.top_logprobs = [list(zip(top_ids[i][:k], top_vals[i][:k]))]
            status = RequestStatus.FINISHED_ABORTED if refused else self._check_stop(req, tok)
            if status is not None:
                self._finish(req, status, None)
                if status != RequestStatus.FINISHED_ABORTED and req.num_output_tokens > 1:
                    self.latency.add("tpot", (now - req.first_token_time) / (req.num_output_tokens - 1),
                                     req.num_prompt_tokens, max(req.num_cached_tokens, 0), req.num_output_tokens)
                delta.finish_reason = req.status.finish_reason
                delta.stop_reason = req.stop_reason
            elif req.prefill_only:
                self.migration.park(req)
                delta.kv_ready = True
            deltas.append(delta)
        return deltas

    def _model_forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The model's forward over ``out``: logits of the rows that sample."""
        return self.runner.execute(out, self.block_manager.block_table)

    def _model_sample(self, row_reqs: list[Request], repeat: list[int], logits: torch.Tensor
                      ) -> tuple[list[int], list[float], list[list[int]] | None, list[list[float]] | None]:
        """Sample a token per row (a forked request's siblings share its logits row): the ids, the
        chosen tokens' logprobs (empty unless a row asks) and the top logprobs (None unless asked)."""
        if len(row_reqs) != len(repeat):
            logits = logits.repeat_interleave(torch.tensor(repeat, device=logits.device), dim=0)
        rows = [self._row(r) for r in row_reqs]
        self.structured.fill(rows, [r.matcher for r in row_reqs])
        result = self.sampler(logits, rows)
        token_ids = result.token_ids.tolist()
        logprobs = result.logprobs.tolist() if any(r.params.logprobs is not None for r in row_reqs) else []
        top_ids = top_vals = None
        if result.top_logprob_ids is not None:
            top_ids = result.top_logprob_ids.tolist()
            top_vals = result.top_logprobs.tolist()
        return token_ids, logprobs, top_ids, top_vals

    def _expand_forks(self, sampling: list[Request]) -> tuple[list[Request], list[int]]:
        """The step's sampling rows; a request finishing its prompt with ``n > 1`` forks its siblings
        here, so all samples share the prompt's KV blocks (and its last logits row: ``repeat``, the
        rows each sampling request stands for)."""
        row_reqs: list[Request] = []
        repeat: list[int] = []
        for req in sampling:
            row_reqs.append(req)
            copies = 1 + req.fork_pending
            if req.fork_pending:
                group = self.groups[req.parent_id or req.request_id]
                for idx in range(1, copies):
                    child = Request(f"{group.request_id}#{idx}", req.prompt_token_ids, req.params,
                                    req.max_total_tokens, arrival_time=req.arrival_time,
                                    priority=req.priority, cache_salt=req.cache_salt,
                                    parent_id=group.request_id, index=idx,
                                    prefill_only=req.prefill_only, tenant=req.tenant)
                    child.matcher = req.matcher.copy() if req.matcher is not None else None
                    self.scheduler.fork(req, child)
                    group.member_ids.append(child.request_id)
                    self._members[child.request_id] = child
                    row_reqs.append(child)
                req.fork_pending = 0
            repeat.append(copies)
        return row_reqs, repeat

    def _row(self, req: Request) -> SamplingRow:
        p = req.params
        needs_history = (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                         or p.presence_penalty != 0.0)
        suppress: list[int] = []
        if req.num_output_tokens < p.min_tokens:
            suppress = [*self.eos_token_ids, *p.stop_token_ids]
        return SamplingRow(p, req.prompt_token_ids if needs_history else (),
                           req.output_token_ids if needs_history else (), req.generator, suppress)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.params
        if req.matcher is not None and req.matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the output is complete: only EOS could follow
        if req.num_output_tokens >= p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, index: int, reason: str, stop_reason: int | str | None
                       ) -> TokenDelta | None:
        """Finish one sample from outside (a stop string matched in the output processor); its
        final delta, or None when it had already ended."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        req = self._members.get(request_id) or self._members.get(f"{request_id}#{index}")
        if req is None:
            return None
        req.stop_reason = stop_reason
        status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_ABORTED
        return self._finish(req, status, None)

    def _finish(self, req: Request, status: RequestStatus, token_ids: list[int] | None) -> TokenDelta:
        """The one reclaim path: frees KV (idempotently) and forgets the request once all samples end."""
        if self.migration.take(req.request_id) or self.paused.pop(req.request_id, None):
            self.block_manager.free(req.request_id)  # KV held outside the scheduler
            req.status = status
        else:
            self.scheduler.finish(req, status)
        gid = self.forget(req)
        return TokenDelta(gid, req.index, token_ids or [], finish_reason=status.finish_reason,
                          stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
                          num_cached_tokens=max(req.num_cached_tokens, 0),
                          position=req.num_output_tokens - len(token_ids or []))

    def forget(self, req: Request) -> str:
        """Drop a terminal sample from the bookkeeping; the group goes once all its samples have."""
        self._members.pop(req.request_id, None)
        gid = req.parent_id or req.request_id
        group = self.groups.get(gid)
        if group is not None and req.fork_pending == 0 and all(
                m not in self._members for m in group.member_ids):
            del self.groups[gid]
        return gid

    def adopt_member(self, req: Request) -> None:
        """Track a sample that arrived with its KV as a member of its client request."""
        gid = req.parent_id or req.request_id
        group = self.groups.get(gid)
        if group is None:
            group = self.groups[gid] = RequestGroup(gid, [], req.num_prompt_tokens)
        group.member_ids.append(req.request_id)
        self._members[req.request_id] = req

    # ------------------------------------------------------------------ KV migration (workers.kv.migration)
    # The engine's side of the hand-off contract, for workers and connectors; ``self.migration`` does it.
    @property
    def parked(self) -> dict[str, Request]:
        """Prefill done, KV held until shipped (read-only view of ``migration.parked``)."""
        return self.migration.parked

    @property
    def incoming(self) -> dict[str, Request]:
        """Blocks reserved, KV being received (read-only view of ``migration.incoming``)."""
        return self.migration.incoming

    def migration_meta(self, member_id: str) -> tuple[MigrationMeta, list[int]]:
        """A parked request's meta and block table: ``KVMigration.migration_meta``."""
        return self.migration.migration_meta(member_id)

    def release_parked(self, member_id: str) -> bool:
        """Free a parked request's blocks once shipped or failed: ``KVMigration.release_parked``."""
        return self.migration.release_parked(member_id)

    def reserve_remote(self, meta: MigrationMeta) -> list[int]:
        """Reserve blocks for an arriving request; the blocks to receive: ``KVMigration.reserve_remote``."""
        return self.migration.reserve_remote(meta)

    def incoming_block_table(self, member_id: str) -> list[int]:
        """Where a reserved request's KV goes: ``KVMigration.incoming_block_table``."""
        return self.migration.incoming_block_table(member_id)

    def admit_remote(self, member_id: str) -> None:
        """The KV has arrived: start decoding it (``KVMigration.admit_remote``)."""
        self.migration.admit_remote(member_id)

    def cancel_remote(self, member_id: str) -> bool:
        """Drop a reservation whose KV never arrived: ``KVMigration.cancel_remote``."""
        return self.migration.cancel_remote(member_id)
