"""`LLM`: the single-process engine (colocated use, tests, and the reference output).

    from engine import LLM, SamplingParams
    llm = LLM()                                   # the shipped checkpoint, fp32, CPU
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Sequence

import torch

from engine.config import SHIPPED_MODEL, EngineConfig, ModelConfig, parse_dtype
from engine.experts import PagedExperts, check_independence, paged_factory, validate_num_resident
from engine.attention import select_attention
from engine.kv_pool import PagePool
from engine.loader import load_model
from engine.moe import select_moe_kernel
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput
from engine.sampling import SampleOutput, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.stop import StopChecker
from engine.tokenizer import Tokenizer
from engine.validate import check_prompt

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str | torch.dtype = "float32",
                 device: str = "cpu", kv_cache_tokens: int = 16384, page_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_prefill_tokens: int = 2048, seed: int = 0, attention: str | None = None,
                 paged_experts_num_resident: int | None = None, paged_experts_prefetch: bool | None = None):
        path = Path(model) if model is not None else SHIPPED_MODEL
        if torch.device(device).type == "cuda" and torch.device(device).index is not None:
            torch.cuda.set_device(torch.device(device))  # streams, events and Triton use it
        self.config = EngineConfig(model=str(path), dtype=parse_dtype(dtype), device=device,
                                   page_size=page_size, kv_cache_tokens=kv_cache_tokens,
                                   max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   max_prefill_tokens=max_prefill_tokens, seed=seed,
                                   paged_experts_num_resident=paged_experts_num_resident,
                                   paged_experts_prefetch=paged_experts_prefetch)
        self.model_config = mc = ModelConfig.from_path(path)
        k = paged_experts_num_resident
        validate_num_resident(k, mc.num_experts, mc.num_experts_per_tok, self.config.dtype)
        self.tokenizer = Tokenizer(path)
        attn = select_attention(device, attention, page_size)
        self.attention_backend = attn.name
        triton_moe = select_moe_kernel(device)
        self.model = load_model(path, mc, self.config.dtype, device, attn, moe_triton=triton_moe,
                                make_experts=paged_factory(k, device, triton_moe) if k is not None else None)
        if k is not None:
            for layer, experts in self.paged_experts().items():
                check_independence(experts.slots, layer)
            prefetch = paged_experts_prefetch
            self.model.prefetch_experts = torch.device(device).type == "cuda" if prefetch is None else prefetch
        self.pool = PagePool(self.config.num_pages, page_size, mc.num_hidden_layers,
                             mc.num_key_value_heads, mc.head_dim, self.config.dtype, device)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_prefill_tokens)
        self.runner = None
        limit = mc.max_position_embeddings
        self.max_model_len = min(max_model_len, limit) if max_model_len else limit
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.runner = ModelRunner(self.model, self.pool, device, self.eos_ids)
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()

    # ---- public API ------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) with continuous batching.

        Returns one output per prompt, in order.  Raises ValueError, adding nothing, when
        any prompt or parameter is invalid.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        reqs = [self._make_request(p, sp) for p, sp in zip(prompts, plist)]
        for req in reqs:
            self.scheduler.add(req)
        done: dict[str, RequestOutput] = {}
        while self.scheduler.has_work():
            for out in self.step():
                done[out.request_id] = out
        return [done[r.request_id] for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the chat template (with the generation prompt) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params)

    def step(self) -> list[RequestOutput]:
        """schedule(), run(batch), update(batch, output).  Returns requests that finished.

        If the step fails, every request is aborted and its pages returned before re-raising.
        """
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            output = self.runner.run(batch)
        except BaseException:
            self.scheduler.abort_all()
            raise
        return self._update(batch, output)

    def paged_experts(self) -> dict[int, PagedExperts]:
        """MoE layer index -> its paged experts (empty when every expert is resident)."""
        return {i: layer.experts for i, layer in enumerate(self.model.layers)
                if isinstance(layer.experts, PagedExperts)}

    def verify_experts(self, on: bool = True) -> None:
        """Guard mode: after each MoE compute the slots it read (and before eviction, every slot
        it gives up) are compared with the host copy; a corrupted one is re-paged and the compute
        run again, so no output comes from a corrupted slot; counted as `corrupt_slots`.  Costs
        a read of those experts per step."""
        for e in self.paged_experts().values():
            e.slots.verify_on_use = on

    def expert_stats(self) -> dict[int, dict]:
        """Per paged MoE layer: hits, misses, hit_rate, bytes_paged, waves, steps, prefetch counters."""
        return {i: e.counters.as_dict() for i, e in self.paged_experts().items()}

    # ---- internals ---------------------------------------------------------------
    def _make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        seed = params.seed if params.seed is not None else \
            int(torch.randint(0, 2**62, (), generator=self._seed_rng))
        return Request(request_id=f"req-{next(self._ids)}", prompt_token_ids=ids, params=params,
                       generator=torch.Generator().manual_seed(seed), prompt=text,
                       stopper=self.stop_checker(params))

    def stop_checker(self, params: SamplingParams) -> StopChecker:
        return StopChecker(params, self.tokenizer, self.eos_ids, self.max_model_len)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        check_prompt(ids, params, self.model_config.vocab_size, self.max_model_len, self.pool.capacity_tokens)

    def _update(self, batch: ScheduledBatch, output: SampleOutput) -> list[RequestOutput]:
        finished = []
        for req, token, lp in zip(batch.requests, output.tokens, output.logprobs):
            if token < 0:
                continue
            req.output_token_ids.append(token)
            if lp is not None:
                req.logprobs.append(lp)
            reason = req.stopper.append(token, req.num_tokens)
            if reason is not None:
                self.scheduler.finish(req, reason)
                finished.append(self._output(req))
        return finished

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
                             text=req.stopper.final_text(),
                             logprobs=req.logprobs if req.params.logprobs is not None else None,
                             finish_reason=req.finish_reason, matched_stop=req.stopper.matched_stop)
