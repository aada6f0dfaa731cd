"""Building the compiled decode step at start-up: the cache directory, the buckets the config
allows, the backend for the device, and compiling every bucket before the first request."""

from __future__ import annotations

import logging
import time

import torch

from engine.compiled.buckets import decode_buckets
from engine.compiled.cache import Progress, use_cache_dir
from engine.compiled.step import CompiledDecode
from engine.config import EngineConfig
from engine.experts.paged import PagedExperts
from engine.kv_pool import PagePool
from engine.models.decoder import DecoderModel, MoeBlock

log = logging.getLogger(__name__)

# Under compilation every MoE layer takes the gathered path: one copy of each (row, expert)
# pair's weights per layer and step.  The buckets whose copies would pass this are left out.
GATHER_BUDGET_BYTES = 1 << 30


def gathered_bytes(model: DecoderModel, rows: int) -> int:
    """The bytes one MoE layer's gathered expert weights take in a compiled step of `rows` rows."""
    per_expert = 0
    for layer in model.layers:
        if isinstance(layer.mlp, MoeBlock):
            experts = layer.mlp.experts
            w13, w2 = (experts.slots.w13, experts.slots.w2) if isinstance(experts, PagedExperts) else (
                getattr(experts, "w13"), getattr(experts, "w2"))
            dense = w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]   # gathered: dense, compute dtype
            per_expert = max(per_expert, dense * model.embed.element_size())
    return rows * model.cfg.num_experts_per_tok * per_expert


def fitting_buckets(model: DecoderModel, buckets: tuple[int, ...], explicit: bool) -> tuple[int, ...]:
    """`buckets` without those whose gathered expert weights pass GATHER_BUDGET_BYTES (batches
    above the largest left run eager).  Raises ValueError when `explicit` (the operator chose
    them) and one does not fit, or when none does."""
    fits = tuple(b for b in buckets if gathered_bytes(model, b) <= GATHER_BUDGET_BYTES)
    if fits == buckets:
        return buckets
    too_big = [b for b in buckets if b not in fits]
    need = gathered_bytes(model, too_big[0]) / (1 << 20)
    if explicit or not fits:
        raise ValueError(f"compile bucket {too_big[0]} would copy {need:.0f} MiB of expert weights per MoE layer "
                         f"and step (the gathered path of a compiled step; at most "
                         f"{GATHER_BUDGET_BYTES >> 20} MiB): choose --compile-buckets up to "
                         f"{fits[-1] if fits else 0}, or --no-compile")
    log.warning("compiling the decode step for batch buckets %s only: bucket %d would copy %.0f MiB of expert "
                "weights per MoE layer and step; larger batches run eager", list(fits), too_big[0], need)
    return fits


def compile_decode(model: DecoderModel, pool: PagePool, config: EngineConfig, max_model_len: int,
                   progress: bool = True) -> CompiledDecode:
    """The compiled decode step of `model` over `pool` for requests of up to `max_model_len`
    tokens, every bucket compiled (or loaded from the cache) now.  Raises ValueError for buckets
    the config does not allow."""
    buckets = fitting_buckets(model, decode_buckets(config.max_num_seqs, config.compile_buckets),
                              explicit=config.compile_buckets is not None)
    cache = use_cache_dir()
    start = time.monotonic()
    if torch.device(config.device).type == "cuda":
        from engine.compiled.cuda_graphs import CudaGraphDecode
        step: CompiledDecode = CudaGraphDecode(model, pool, buckets,
                                               max_pages=-(-max_model_len // config.page_size))
        if step.paged:
            from engine.kernels.triton.expert_copy import check_mapped_page_in
            try:
                check_mapped_page_in(config.device)
            except RuntimeError as e:
                log.warning("%s: every paged step is planned on the host (one sync per MoE layer)", e)
                step.device_paging = False
    else:
        step = CompiledDecode(model, pool, buckets)
    step.warm_up(Progress() if progress else None)
    step.compile_s = time.monotonic() - start
    log.info("compiled the decode step for batch buckets %s in %.1f s (cache %s)", list(buckets),
             step.compile_s, cache)
    return step
