"""Every CUDA path, on a CUDA device (`pytest -m cuda`; all skip without one).

Compiled Triton kernels against their torch references; paged experts over CUDA copy streams
(pinned host store, prefetch on) bit-identical to all-resident; the start-up independence
check and the preflight link probe on the device; a disaggregated request through in-process
gRPC prefill and decode workers with their pools on the device (pinned staging of frames,
per-layer events), greedy tokens equal to the single-process engine's; the transfer fault
points against CUDA pools, where a refused frame writes nothing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import SHIPPED_MODEL, ModelConfig
from tests.test_paged_experts import NATURAL  # the same prompts as the CPU test

DEVICE = "cuda"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


# ---- kernels, compiled -------------------------------------------------------------------

def test_paged_attention_compiled_matches_reference() -> None:
    from tests.test_kernel_paged_attention import run_cases
    failed = {name: err for name, err in run_cases(DEVICE).items() if err is not None}
    assert not failed, failed


def test_fused_moe_compiled_matches_reference() -> None:
    from tests.test_kernel_fused_moe import run_cases
    failed = {name: err for name, err in run_cases(DEVICE).items() if err is not None}
    assert not failed, failed


# ---- paged experts over CUDA copy streams ----------------------------------------------------

@pytest.fixture(scope="module")
def cuda_reference() -> tuple[LLM, dict[int, list]]:
    llm = LLM(device=DEVICE)
    return llm, {b: llm.generate(NATURAL[:b], PARAMS) for b in (1, 3, 8, 17)}


def _ks() -> list[int]:
    """K in {top_k, E/4, E/2} for the shipped model."""
    mc = ModelConfig.from_path(SHIPPED_MODEL)
    return sorted({mc.num_experts_per_tok, mc.num_experts // 4, mc.num_experts // 2})


@pytest.mark.parametrize("k", _ks())
def test_paged_experts_bit_identical_on_cuda(k: int, cuda_reference) -> None:
    from engine.experts import CudaStreamCopy
    _, reference = cuda_reference
    llm = LLM(device=DEVICE, paged_experts_num_resident=k, paged_experts_prefetch=True)
    layers = llm.paged_experts()
    assert all(isinstance(e.slots.copier, CudaStreamCopy) for e in layers.values())
    assert all(e.slots.store.w13.is_pinned() and e.slots.w13.is_cuda for e in layers.values())
    for batch, want in reference.items():
        got = llm.generate(NATURAL[:batch], PARAMS)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs      # exact, every step, every entry
    stats = llm.expert_stats()
    assert all(s["misses"] > 0 for s in stats.values())
    if k == ModelConfig.from_path(SHIPPED_MODEL).num_experts // 4:   # as tests/test_paged_experts.py at K = 16
        assert sum(stats[i]["prefetched"] for i in stats if i > 0) > 0, "the prefetcher never copied"
    llm.pool.check_integrity()


def test_startup_independence_check_on_cuda() -> None:
    from engine.experts import CudaStreamCopy
    from engine.experts.check import ExpertCheckError, check_independence, verify_resident
    llm = LLM(device=DEVICE, paged_experts_num_resident=16)
    for layer, experts in llm.paged_experts().items():
        check_independence(experts.slots, layer)
        verify_resident(experts.slots, layer)

    class Corrupt(CudaStreamCopy):
        def copy(self, pairs, after=None, prefetch=False):
            done = super().copy(pairs, after, prefetch)
            done.wait()
            for dst, _ in pairs:
                dst.view(-1)[0] += 1.0
            return done
    slots = llm.paged_experts()[0].slots
    slots.copier = Corrupt(slots.w13.device)
    with pytest.raises(ExpertCheckError, match="layer 0: expert"):
        check_independence(slots, layer=0)


def test_preflight_measures_the_pinned_link() -> None:
    from engine.experts.preflight import preflight
    r = preflight(SHIPPED_MODEL, memory_gib=0.05, device=DEVICE)
    assert r["link_measured_by"] == "pinned host-to-device copy"
    assert r["link_bytes_per_s"] > 1e9, r["link_bytes_per_s"]


# ---- disaggregated workers with their pools on the device ------------------------------------

@pytest.mark.parametrize("transfer", ["grpc", "shm"])
def test_disaggregated_on_cuda_equals_the_engine(transfer: str, cuda_reference) -> None:
    from tests.workers import channel, config, run, start_decode, start_prefill, wait_idle
    llm, _ = cuda_reference
    tok = llm.tokenizer
    prompts = [tok.encode(t) for t in NATURAL[:8]] + [tok.encode("word " * 300)]   # one chunked prefill
    params = SamplingParams(max_tokens=16, temperature=0)
    want = llm.generate(prompts, params)
    cfg = config(device=DEVICE, paged_experts_num_resident=16, max_prefill_tokens=128, transfer=transfer)
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    try:
        assert decode.core.pool.kv.device.type == prefill.core.pool.kv.device.type == DEVICE
        dch, pch = channel(decode.address), channel(prefill.address)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda i: run(dch, pch, f"g{i}", prompts[i], params), range(len(prompts))))
        for w, g in zip(want, got):
            assert g.error is None, g.error
            assert g.token_ids == w.token_ids and g.text == w.text
        wait_idle(decode, prefill)
    finally:
        decode.stop()
        prefill.stop()


# ---- transfer fault points against CUDA pools -----------------------------------------------

FAULT_PROMPT = 18     # 5 pages of 4 tokens
FAULTS = [("corrupt_payload", "BAD_CHECKSUM"), ("alter_header", "BAD_CHECKSUM"), ("drop", "INCOMPLETE"),
          ("duplicate", "DUPLICATE"), ("commit_early", "INCOMPLETE"), ("replay_foreign", "BAD_TAG"),
          ("cut", "STREAM_CLOSED"), ("reorder", None), ("delay", None)]


def _cuda_pool(seed: int):
    from engine.kv_pool import PagePool
    from tests.kv_helpers import DIM, HEADS, LAYERS, PAGE
    pool = PagePool(64, PAGE, LAYERS, HEADS, DIM, torch.bfloat16, device=DEVICE)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def _open(src, dst, recv, server, rid, faults):
    from tests.kv_helpers import open_transfer
    return open_transfer(src, dst, recv, server, rid, faults, FAULT_PROMPT)


def _send(sender):
    from kv_transfer.errors import TransferRefused
    from tests.kv_helpers import LAYERS
    try:
        sender.send_layers(0, LAYERS)
        sender.commit(3, -0.1)
    except TransferRefused as e:
        return e
    return None


def _blocks_stale_or_sent(src, dst, before: torch.Tensor, rid: str) -> bool:
    """Every (layer, K/V, page) block of rid's destination pages holds either the bytes it held
    before the transfer or exactly the sender's: a refused frame wrote nothing."""
    sent = src.page_table(rid)
    for i, b in enumerate(dst.page_table(rid)):          # the reserved pages, the spare one too
        n = min(src.page_size, max(FAULT_PROMPT - i * src.page_size, 0))
        for layer in range(dst.kv.shape[0]):
            for kv in (0, 1):
                now, old = dst.kv[layer, kv, b], before[layer, kv, b]
                if torch.equal(now, old):
                    continue
                if n == 0 or not torch.equal(now[:n], src.kv[layer, kv, sent[i], :n]) \
                        or not torch.equal(now[n:], old[n:]):
                    return False
    return True


@pytest.mark.parametrize("point, reason", FAULTS)
def test_fault_points_against_a_cuda_pool(point: str, reason: str | None) -> None:
    from chaos.sender_faults import FaultInjector
    from kv_transfer.errors import Refusal
    from kv_transfer.receiver import TransferReceiver
    from kv_transfer.reservation import State
    from kv_transfer.transport.local import LocalServer
    from tests.kv_helpers import SECRET
    src, dst = _cuda_pool(1), _cuda_pool(2)
    recv = TransferReceiver(dst, SECRET)
    server = LocalServer(recv, f"cuda-faults-{point}")
    try:
        faults = FaultInjector(seed=1)
        warm, sender = _open(src, dst, recv, server, "warm", faults)
        assert _send(sender) is None                   # an earlier transfer to replay from
        faults.arm(point, after=0 if point == "commit_early" else 1, seconds=0.05)
        before = dst.kv.clone()
        res, sender = _open(src, dst, recv, server, "victim", faults)
        err = _send(sender)
        assert faults.fired[point] == 1
        assert _blocks_stale_or_sent(src, dst, before, "victim")
        if reason is None:
            assert err is None and res.state == State.COMMITTED
        else:
            assert err is not None and res.state == State.FAILED and res.reason == Refusal[reason], (err, res.reason)
        for r, rid in ((res, "victim"), (warm, "warm")):
            recv.release(r.transfer_id)
            dst.free(rid)
            src.free(rid)
        dst.check_integrity()
        assert dst.num_free == dst.num_pages
    finally:
        server.stop()
