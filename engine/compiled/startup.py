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
from engine.kv_pool import PagePool
from engine.models.decoder import DecoderModel

log = logging.getLogger(__name__)


def compile_decode(model: DecoderModel, pool: PagePool, config: EngineConfig, max_model_len: int,
                   progress: bool = True) -> CompiledDecode:
    """The compiled decode step of `model` over `pool` for requests of up to `max_model_len`
    tokens, every bucket compiled (or loaded from the cache) now.  Raises ValueError for buckets
    the config does not allow."""
    buckets = decode_buckets(config.max_num_seqs, config.compile_buckets)
    cache = use_cache_dir()
    start = time.monotonic()
    if torch.device(config.device).type == "cuda":
        from engine.compiled.cuda_graphs import CudaGraphDecode
        step: CompiledDecode = CudaGraphDecode(model, pool, buckets,
                                               max_pages=-(-max_model_len // config.page_size))
    else:
        step = CompiledDecode(model, pool, buckets)
    step.warm_up(Progress() if progress else None)
    step.compile_s = time.monotonic() - start
    log.info("compiled the decode step for batch buckets %s in %.1f s (cache %s)", list(buckets),
             step.compile_s, cache)
    return step
