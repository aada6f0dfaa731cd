"""`LLM`: the single-process engine (offline use, tests, and the reference output the workers'
results are compared with), a thin layer over the `EngineCore` the workers drive.

    from engine import LLM, SamplingParams
    llm = LLM()                                   # the shipped checkpoint, EngineConfig's defaults
    llm = LLM(kv_cache_tokens=4096, compile=False)   # any EngineConfig field, by name
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from engine.config import EngineConfig, ModelConfig
from engine.core import EngineCore
from engine.errors import ErrorCode, RequestError
from engine.experts import PagedExperts
from engine.kv_pool import PagePool
from engine.models.decoder import DecoderModel
from engine.params import SamplingParams
from engine.prefix_cache import cache_salt as derive_salt
from engine.request import Request, RequestOutput
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> bool:
    """A text, or a sequence of token ids (not a list of prompts)."""
    return isinstance(prompts, str) or bool(prompts and isinstance(prompts[0], int))


class LLM:
    def __init__(self, model: str | Path | None = None, *, attention: str | None = None,
                 prompt_special_tokens: bool = False, **overrides: Any) -> None:
        """The engine on `model` (default: the shipped checkpoint).  `overrides`: EngineConfig's
        fields by name (kv_cache_tokens=4096, dtype="bfloat16", compile=False, ...: each
        field's help in engine/config.py says what it does and its default); an unknown name
        is a TypeError, a bad value a ValueError.  `attention`: the attention backend's name
        (default: the device's).  `prompt_special_tokens`: a prompt string's added tokens'
        text (`<|im_end|>`) reads as their control ids, as the gateway's flag of that name
        (default: a prompt string is text; token-id prompts are taken as they are)."""
        self.prompt_special_tokens = prompt_special_tokens
        config = EngineConfig(**overrides) if model is None else EngineConfig(model=str(model), **overrides)
        self.core = EngineCore(config, attention)

    # ---- the core's parts, read by tests, benchmarks and tools -----------------
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def model(self) -> DecoderModel:
        return self.core.model

    @property
    def pool(self) -> PagePool:
        return self.core.pool

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.core.eos_ids

    @property
    def attention_backend(self) -> str:
        return self.core.attention_backend

    # ---- public API ------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str = "") -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) with continuous batching.  Requests
        share cached prompt prefixes only with requests of the same `cache_salt`.

        `SamplingParams.constraint` (structured outputs): every token of that request follows
        its grammar (after its `after` marker); a constraint the grammar engine cannot compile
        is a RequestError (INVALID_REQUEST, naming the problem) and nothing is added.

        Returns one output per prompt, in order.  Raises ValueError, adding nothing, when
        any prompt or parameter is invalid; raises RequestError (INVALID_REQUEST) once every
        request has ended when a request's stop_regex ran past its per-token budget (the
        message names the pattern; `step` returns such a request with finish_reason "error").
        """
        batch: list[Prompt] = [prompts] if _is_one_prompt(prompts) else list(prompts)  # type: ignore[list-item,arg-type]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(plist)} sampling params")
        reqs = [self._make_request(p, sp, cache_salt) for p, sp in zip(batch, plist)]
        for req in reqs:
            self.core.add(req)
        done: dict[str, RequestOutput] = {}
        while self.scheduler.has_work():
            for out in self.step():
                done[out.request_id] = out
        for req in reqs:
            if req.stopper is not None and req.stopper.error is not None:
                raise RequestError(ErrorCode.INVALID_REQUEST, req.stopper.error)
        return [done[r.request_id] for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             cache_salt: str = "") -> list[RequestOutput]:
        """Apply the chat template (with the generation prompt) and generate: the messages' text
        is text (control ids come from the template's structure only, as in the gateway)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=True) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, cache_salt)

    def step(self) -> list[RequestOutput]:
        """schedule(), run(batch), update(batch, output).  Returns requests that finished.

        If the step fails, every request is aborted and its pages returned before re-raising.
        """
        core = self.core
        batch = core.schedule()
        if batch is None:
            return []
        try:
            output = core.run(batch)
        except BaseException:
            core.abort_all()
            raise
        return [self._output(e.req) for e in core.update(batch, output) if e.finished]

    def paged_experts(self) -> dict[int, PagedExperts]:
        """MoE layer index -> its paged experts (empty when every expert is resident)."""
        return self.core.paged_experts()

    def verify_experts(self, on: bool = True) -> None:
        """Guard mode (see `EngineCore.verify_experts`)."""
        self.core.verify_experts(on)

    def expert_stats(self) -> dict[int, dict]:
        """Per paged MoE layer: hits, misses, hit_rate, bytes_paged, waves, steps, prefetch counters."""
        return self.core.expert_stats()

    def add_request(self, prompt: Prompt, params: SamplingParams, cache_salt: str = "") -> Request:
        """Queue one request without running it (drive it with `step()`).  Raises ValueError,
        queuing nothing, when the prompt or a parameter is invalid."""
        req = self._make_request(prompt, params, cache_salt)
        self.core.add(req)
        return req

    # ---- internals ---------------------------------------------------------------
    def _make_request(self, prompt: Prompt, params: SamplingParams, cache_salt: str = "") -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        # one process, one tenant: no secret; `cache_salt` splits the cache further
        return self.core.make_request(ids, params, prompt=text, salt=derive_salt(b"", "", cache_salt))

    def _encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        return tok.encode(text) if self.prompt_special_tokens else tok.encode_plain(text)

    def _output(self, req: Request) -> RequestOutput:
        assert req.stopper is not None and req.finish_reason is not None
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
                             text=req.stopper.final_text(),
                             logprobs=req.logprobs if req.params.logprobs is not None else None,
                             finish_reason=req.finish_reason, matched_stop=req.stopper.matched_stop,
                             prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
                             num_cached_tokens=req.num_cached_tokens)

