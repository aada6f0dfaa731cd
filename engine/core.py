"""`EngineCore`: one model, one KV pool and the one scheduler of that pool, stepped as

    batch  = core.schedule()
    output = core.run(batch)
    events = core.update(batch, output)     # the one token path

The single-process `LLM` and every worker (prefill, decode, colocated) drive a core; nothing
else schedules over its pool.  `update` (and `accept_token`, for a first token that came
with a KV transfer) is the only code that appends a sampled token to a request, runs its
stop checks and hands a finished request's pages back to the pool.

Who frees which pages when:
- a request that finishes (stop, length, or "error": its stop check ran past the budget,
  `req.stopper.error` says why) is freed by `update`/`accept_token`, at once;
- a hand-off request (`Request.handoff`: prefill for another worker) is detached after its
  first token (or by `detach`, a failed step) with its pages kept; its owner releases them
  once the push has ended;
- every other release is `release(req)`, the one door a role has: it drops the request
  wherever it is (queued, running, detached, or reserved outside the scheduler) and frees its
  pages.  Roles never call the pool's `free` themselves.

Prefix cache (engine/prefix_cache.py): a request is admitted with the longest cached prefix of
its prompt under its `cache_salt` (`allocate_for` for a reservation made outside the
scheduler); its full prompt pages are published when its prompt is complete (computed here,
or imported: `add_prefilled`), and every full computed page when it ends, before its pages are
released (`publish` for a worker that ends a request itself).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from engine.compiled.cache import use_cache_dir
from engine.compiled.startup import compile_decode
from engine.config import EngineConfig, ModelConfig
from engine.constraint import Constraint, GrammarCompiler
from engine.errors import ErrorCode, RequestError
from engine.experts import PagedExperts, validate_num_resident
from engine.guide import Guide
from engine.guided_mask import MaskWork
from engine.guides import Guides
from engine.kv_pool import PagePool
from engine.loader import load_engine_model
from engine.model_runner import ModelRunner
from engine.params import SamplingParams
from engine.request import Request, Status
from engine.sampling import SampleOutput, request_generator
from engine.scheduler import ScheduledBatch, Scheduler
from engine.stop import StopChecker, StopLimits
from engine.tokenizer import Tokenizer
from engine.validate import check_generated, check_prompt

LayerHook = Callable[[int], None]


@dataclass(frozen=True)
class TokenEvent:
    """One token appended to a request by the token path, and whether it ended the request
    (token -1: a prefill-only request ended with its prompt computed, nothing generated)."""
    req: Request
    token: int
    logprobs: dict[int, float] | None
    finish_reason: str | None          # "stop", "length", "error", "handoff" (pages kept), or None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCore:
    def __init__(self, config: EngineConfig, attention: str | None = None, interleave: bool = False,
                 stop_limits: StopLimits = StopLimits()):
        """Load the checkpoint `config.model` and size the KV pool.  `interleave`: the scheduler
        follows each prefill step with a decode step (a worker that prefills and decodes).
        `stop_limits`: the regex window and per-token budget of every request's stop checks.
        Raises ValueError naming the setting to change, CheckpointError naming the tensor,
        ExpertCheckError when the start-up check of paged experts fails."""
        self.config, self.stop_limits = config, stop_limits
        self._load(attention)
        device, mc = config.device, self.model_config
        components, kv_heads, kv_dim = mc.kv_geometry
        self.pool = PagePool(config.num_pages, config.page_size, mc.num_hidden_layers,
                             kv_heads, kv_dim, config.torch_dtype, device, kv_components=components,
                             enable_prefix_cache=config.enable_prefix_cache, audit=config.kv_audit)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_prefill_tokens, interleave)
        limit = mc.max_position_embeddings
        self.max_model_len = min(config.max_model_len, limit) if config.max_model_len else limit
        self.eos_ids = self.tokenizer.end_ids(mc.eos_token_ids)
        self.runner = ModelRunner(self.model, self.pool, device, mc.vocab_size, self.eos_ids)
        if config.compile:
            self.runner.compiled = compile_decode(self.model, self.pool, config, self.max_model_len)
        self.guides = Guides(self.tokenizer, mc.vocab_size, self.eos_ids, config.grammar_check_timeout_s)
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()

    def _load(self, attention: str | None) -> None:
        """The checkpoint's config.json, tokenizer and model (engine/loader.py), on the
        config's device; the settings refused before the weights are read."""
        config = self.config
        device, path = torch.device(config.device), Path(config.model)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)      # streams, events and Triton use it
        if config.compile:
            use_cache_dir()   # an unusable cache directory fails before the model loads
        self.model_config = mc = ModelConfig.from_path(path)
        validate_num_resident(config.paged_experts_num_resident, mc.num_experts, mc.num_experts_per_tok,
                              config.torch_dtype)
        self.tokenizer = Tokenizer(path)
        self.model = load_engine_model(config, mc, attention)
        self.attention_backend = self.model.attention.name

    # ---- requests --------------------------------------------------------------------
    def check(self, ids: list[int], params: SamplingParams, reserve_output: bool = True) -> None:
        """Raises RequestError (INVALID_REQUEST, PROMPT_TOO_LONG) naming the problem and the limit."""
        check_prompt(ids, params, self.model_config.vocab_size, self.max_model_len,
                     self.pool.capacity_tokens, reserve_output)

    def make_request(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
                     prompt: str | None = None, handoff: bool = False,
                     generator: torch.Generator | None = None, salt: bytes = b"",
                     generated: Sequence[int] = ()) -> Request:
        """A checked request (not yet scheduled).  Without a generator, one is made from the
        seed (drawn from the core's seeded generator when there is none).  `salt`: its
        prefix-cache salt (`prefix_cache.cache_salt`: requests share cached pages only with
        requests of the same salt).

        `generated` (a migrated request): the tokens already generated for `ids` elsewhere.  The
        request then computes KV for `ids + generated` (`Request.resumed` of them generated),
        its generator is past their draws, the scheduler's limits are what is left
        (`resumed_params`), and its stop checks have replayed them with `params`
        (`StopChecker.replay`).  When they already end it (the last one stops, or max_tokens),
        it comes back FINISHED with its finish_reason, never to be scheduled.

        `params.constraint`: the request gets a `Guide` (its grammar, compiled here or copied
        from the compiler's cache), fed `generated` too; a constraint the grammar engine refuses,
        or generated tokens it refuses, raise RequestError (INVALID_REQUEST) naming the problem.
        Raises RequestError, creating nothing."""
        self.check(ids, params, reserve_output=not handoff)
        check_generated(generated, params, self.model_config.vocab_size, handoff)
        guide = self.guide(params.constraint, replay=generated if handoff else ())  # else: the stopper's
        g = len(generated)
        if generator is None:
            seed = params.seed if params.seed is not None else \
                int(torch.randint(0, 2**62, (), generator=self._seed_rng))
            generator = request_generator(seed, 0 if params.greedy else g)
        stopper = None if handoff else self.resume_checker(params, len(ids), generated, guide)
        ended = stopper is not None and stopper.finish_reason is not None
        req = Request(request_id=request_id or f"req-{next(self._ids)}", prompt_token_ids=[*ids, *generated],
                      params=params if ended else resumed_params(params, g), generator=generator,
                      prompt=prompt, handoff=handoff, stopper=stopper, cache_salt=salt, resumed=g,
                      guide=guide)
        if ended:
            assert stopper is not None
            req.status, req.finish_reason = Status.FINISHED, stopper.finish_reason
        return req

    def resume_checker(self, params: SamplingParams, prompt_len: int, generated: Sequence[int],
                       guide: Guide | None = None) -> StopChecker:
        """A request's stop checker (advancing `guide`), replayed over `generated`
        (`StopChecker.replay`).  Raises RequestError (INVALID_REQUEST) when a stop fires before
        the last of them, a stop check ran past its budget, or the grammar refuses one."""
        stopper = self.stop_checker(params, guide)
        try:
            stopper.replay(generated, prompt_len)
        except ValueError as e:
            raise RequestError(ErrorCode.INVALID_REQUEST, str(e)) from None
        if stopper.finish_reason == "error":
            assert stopper.error is not None
            raise RequestError(ErrorCode.INVALID_REQUEST, stopper.error)
        return stopper

    def stop_checker(self, params: SamplingParams, guide: Guide | None = None) -> StopChecker:
        return StopChecker(params, self.tokenizer, self.eos_ids, self.max_model_len, self.stop_limits,
                           guide=guide)

    # ---- structured outputs ----------------------------------------------------------
    @property
    def grammars(self) -> GrammarCompiler:
        """The core's grammar compiler (`engine.guides.Guides.compiler`)."""
        return self.guides.compiler

    def guide(self, constraint: Constraint | None, replay: Sequence[int] = ()) -> Guide | None:
        """A request's grammar state (`engine.guides.Guides.guide`)."""
        return self.guides.guide(constraint, replay)

    @property
    def mask_work(self) -> MaskWork:
        """What the grammar masks have cost (rows masked, fill and apply seconds)."""
        return self.runner.masker.work

    def add(self, req: Request) -> None:
        """Queue a request to prefill here (its pages are allocated when it is admitted)."""
        self.scheduler.add(req)

    def allocate_for(self, req: Request, reserved_tokens: int) -> int:
        """Reserve pages for `reserved_tokens` of `req` outside the scheduler (a decode worker's
        reservation): its longest cached prompt prefix, then private pages.  Returns the cached
        tokens (a multiple of the page size, below the prompt length; 0 with the cache off).
        Raises PoolExhausted, reserving nothing."""
        return self.scheduler.allocate(req, reserved_tokens)

    def publish(self, req: Request) -> int:
        """Publish every full page of `req`'s computed tokens into the prefix cache (read-only
        from then on).  Returns how many pages were published."""
        return self.scheduler.publish(req)

    def add_prefilled(self, req: Request, first_token: int, logprobs: dict[int, float] | None) -> TokenEvent:
        """A request whose prompt KV was imported into the pages it holds (written, verified),
        and the first token sampled with it: its full prompt pages are published, and it joins
        the decode batch unless that token already ended it."""
        self.scheduler.add_prefilled(req)
        return self.accept_token(req, first_token, logprobs)

    def release(self, req: Request) -> None:
        """The one door through which a role hands a request's pages back, whatever its state.
        Waiting, ready or running: it is dropped from the scheduler ("abort") and its computed
        full pages are published first.  Outside the scheduler (a reservation made with
        `allocate_for` that never joined it, or a hand-off detached after its first token):
        its pages are freed as they are, publishing nothing more.  A request holding no pages:
        nothing changes.  The caller makes sure no transfer can still write them (DESIGN I5)."""
        if not self.scheduler.remove(req, "abort"):
            self.pool.free(req.request_id)

    def detach(self, req: Request) -> None:
        """Take a running hand-off request out of the batch with its pages kept (a push still
        reads them: its owner releases them once the push has ended).  Not running: nothing."""
        if req in self.scheduler.running:
            self.scheduler.detach(req)

    # ---- the step --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        return self.scheduler.schedule()

    def run(self, batch: ScheduledBatch, on_layer: LayerHook | None = None) -> SampleOutput:
        return self.runner.run(batch, on_layer)

    def update(self, batch: ScheduledBatch, output: SampleOutput) -> list[TokenEvent]:
        """The token path: every request that sampled a token this step gets it (a request
        whose prompt this step completed publishes its full prompt pages first)."""
        if batch.is_prefill:
            for req in batch.requests:
                if not req.prefilling:
                    self.scheduler.publish(req)
        events = [self.accept_token(req, token, lp)
                  for req, token, lp in zip(batch.requests, output.tokens, output.logprobs) if token >= 0]
        return events + [self._prefilled_only(req) for req in batch.requests
                         if req.params.prefill_only and not req.prefilling and req.status is Status.RUNNING]

    def _prefilled_only(self, req: Request) -> TokenEvent:
        """A prefill-only request (max_tokens 0) whose prompt is computed: it ends ("length",
        token -1) with nothing generated; a hand-off is detached with its pages kept (its owner
        releases them), any other request's pages go back to the pool here."""
        if req.handoff:
            self.scheduler.detach(req)
            req.finish_reason = "length"
        else:
            self.scheduler.finish(req, "length")
        return TokenEvent(req, -1, None, "length")

    def accept_token(self, req: Request, token: int, logprobs: dict[int, float] | None) -> TokenEvent:
        """Append `token` (and its logprobs) to `req`, run its stop checks, and end it when it
        stops (or its stop check ran past the budget: "error"): a finished request's pages go
        back to the pool here; a hand-off request is detached with its pages kept after its
        first token."""
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        if req.handoff:
            reason: str | None = "handoff"
            self.scheduler.detach(req)
        else:
            assert req.stopper is not None, f"{req.request_id} has no stop checker"
            reason = req.stopper.append(token, req.num_tokens)
            if reason is not None:
                self.scheduler.finish(req, reason)
        return TokenEvent(req, token, logprobs, reason)

    def abort_all(self) -> None:
        """Drop every request, returning all their pages (a failed step)."""
        self.scheduler.abort_all()

    # ---- paged experts -----------------------------------------------------------------
    def paged_experts(self) -> dict[int, PagedExperts]:
        """MoE layer index -> its paged experts (empty when every expert is resident)."""
        return self.model.paged_experts()

    def verify_experts(self, on: bool = True) -> None:
        """Guard mode: after each MoE compute the slots it read (and before eviction, every slot
        it gives up) are compared with the host copy; a corrupted one is re-paged and the compute
        run again, so no output comes from a corrupted slot; counted as `corrupt_slots`.  Costs
        a read of those experts per step."""
        for e in self.paged_experts().values():
            e.slots.verify_on_use = on

    def expert_formats(self) -> dict[int, str]:
        """MoE layer index -> its routed experts' storage format (a dtype or a quantized format)."""
        return self.model.expert_formats()

    def expert_stats(self) -> dict[int, dict]:
        """Per paged MoE layer: hits, misses, hit_rate, bytes_paged, waves, steps, prefetch counters."""
        return {i: e.counters.as_dict() for i, e in self.paged_experts().items()}


def resumed_params(params: SamplingParams, generated: int) -> SamplingParams:
    """The scheduler's and sampler's limits of a request with `generated` tokens already made:
    max_tokens and min_tokens less them (its KV reservation, prompt + max_tokens, is unchanged)."""
    if not generated:
        return params
    return replace(params, max_tokens=params.max_tokens - generated,
                   min_tokens=max(0, params.min_tokens - generated))
