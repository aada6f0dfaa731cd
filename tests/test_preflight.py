"""`tandem preflight`: sizes from config.json, a K recommendation, readable refusals."""

import json
from pathlib import Path

import pytest

from deploy.cli import main
from engine.experts.preflight import preflight


def test_preflight_figures_for_the_shipped_model():
    r = preflight("models/tiny-moe", memory_gib=0.02, dtype="bfloat16", concurrency=8,
                  target_tok_s=100.0, link_bytes_per_s=2e6)
    assert r["bytes_per_expert"] == 3 * 128 * 64 * 2
    assert r["slot_cost_bytes"] == 6 * r["bytes_per_expert"]
    assert r["kv_bytes_per_token"] == 2 * 6 * 2 * 32 * 2
    assert r["slot_cost_kv_tokens"] == 192
    assert r["host_store_bytes"] == 64 * r["slot_cost_bytes"]
    assert r["recommended_k"] == 32 and r["single_wave_batch_cap"] == 8
    # 100 tokens/s x 4 experts x 6 layers x 49152 bytes = 118 MB/s if every expert missed
    assert r["max_miss_rate_for_target"] == pytest.approx(2e6 / (100 * 4 * 6 * 49152))


def test_preflight_command_prints_text_and_json(capsys):
    assert main(["preflight", "--memory-gib", "0.05", "--link-gbps", "16"]) == 0
    text = capsys.readouterr().out
    assert "one wave serves up to" in text and "KV-cache tokens" in text
    assert main(["preflight", "--memory-gib", "0.05", "--link-gbps", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended_k"] == 32


def test_preflight_refuses_a_budget_too_small(capsys):
    assert main(["preflight", "--memory-gib", "0.001", "--link-gbps", "16"]) == 2
    assert "raise --memory-gib" in capsys.readouterr().err


# models/published/<name>/config.json: the published config.json of each real model.  By hand,
# at bf16 (2 bytes): KV per token = layers x components x kv_heads x head_dim x 2 (MLA: one
# kv_lora_rank + qk_rope_head_dim row); one routed expert = gate, up and down (H x I each) plus,
# for gpt-oss, its biases (2I + H), held as the checkpoint publishes them:
#   block fp8 (DeepSeek-V3, Kimi-K2): 1 byte a weight + an fp32 scale per 128 x 128 block
#     (gate/up [2048, 7168] and down [7168, 2048]: 16 x 56 blocks each);
#   mxfp4 (gpt-oss): 16 bytes of 32 values + a 1-byte exponent per 32 inputs, for gate_up
#     [2I, H] and down [H, I] (rows x 90 blocks x 17 bytes); the biases bf16;
#   GPTQ int4 g128 (Qwen3-30B-A3B): qweight in/8 x out int32, qzeros in/128 x out/8 int32,
#     scales in/128 x out fp16, g_idx in int32: gate/up (out 768, in 2048) 825,344 bytes each,
#     down (out 2048, in 768) 820,224.
PUBLISHED = Path(__file__).resolve().parent.parent / "models" / "published"
BY_HAND = {
    #                      KV bytes per token     bytes per routed expert               E    top_k MoE layers
    "deepseek-v3":       (61 * 1 * 1 * 576 * 2, 3 * (7168 * 2048 + 56 * 16 * 4),      256, 8, 58),
    "kimi-k2":           (61 * 1 * 1 * 576 * 2, 3 * (7168 * 2048 + 56 * 16 * 4),      384, 8, 60),
    "glm-4.5":           (92 * 2 * 8 * 128 * 2, 3 * 5120 * 1536 * 2,                  160, 8, 89),
    "glm-4.5-air":       (46 * 2 * 8 * 128 * 2, 3 * 4096 * 1408 * 2,                  128, 8, 45),
    "mixtral-8x7b":      (32 * 2 * 8 * 128 * 2, 3 * 4096 * 14336 * 2,                 8, 2, 32),
    "qwen1.5-moe-a2.7b": (24 * 2 * 16 * 128 * 2, 3 * 2048 * 1408 * 2,                 60, 4, 24),
    "gpt-oss-20b":       (24 * 2 * 8 * 64 * 2, 3 * 2880 * 90 * 17 + (2 * 2880 + 2880) * 2, 32, 4, 24),
    "gpt-oss-120b":      (36 * 2 * 8 * 64 * 2, 3 * 2880 * 90 * 17 + (2 * 2880 + 2880) * 2, 128, 4, 36),
    "qwen3-30b-a3b":     (48 * 2 * 4 * 128 * 2, 3 * 2048 * 768 * 2,                  128, 8, 48),
    "qwen3-30b-a3b-gptq-int4": (48 * 2 * 4 * 128 * 2, 2 * 825_344 + 820_224,          128, 8, 48),
}


def test_every_published_config_is_checked_by_hand():
    assert sorted(p.name for p in PUBLISHED.iterdir()) == sorted(BY_HAND)


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_preflight_of_the_published_models(name):
    r = preflight(PUBLISHED / name, memory_gib=139, dtype="bfloat16", concurrency=8, link_bytes_per_s=50e9)
    kv, expert, e, top_k, layers = BY_HAND[name]
    assert r["kv_bytes_per_token"] == kv
    assert r["bytes_per_expert"] == expert
    assert (r["num_experts"], r["top_k"], r["moe_layers"]) == (e, top_k, layers)
    assert r["slot_cost_bytes"] == layers * expert and r["host_store_bytes"] == e * layers * expert
    assert r["link_measured_by"] == "given"
    # it fits one H200 (139 GiB) with top_k experts per layer resident
    assert r["non_expert_bytes"] + top_k * r["slot_cost_bytes"] < 139 * 2**30
    assert r["kv_cache_tokens_at_top_k"] > 100_000
    assert r["kv_cache_tokens_at_top_k"] >= r["kv_cache_tokens_at_recommended_k"]


def test_resident_bytes_by_hand():
    """Everything but routed experts stays on the device; counted by hand for two families."""
    mixtral = preflight(PUBLISHED / "mixtral-8x7b", memory_gib=139, link_bytes_per_s=50e9)
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 2 * 4096 + 8 * 4096   # q, o, k, v, 2 norms, router
    assert mixtral["non_expert_bytes"] == (32 * layer + 2 * 32000 * 4096 + 4096) * 2
    dsv3 = preflight(PUBLISHED / "deepseek-v3", memory_gib=139, link_bytes_per_s=50e9)
    mla = (1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128
           + 2 * 7168)                                    # q_a, q_a norm, q_b, kv_a, kv_a norm, kv_b, o, 2 norms
    dense = 3 * 7168 * 18432                              # the first 3 layers' MLP
    shared = 3 * 7168 * 2048                              # the shared expert
    router = 256 * 7168 + 256                             # router and its correction bias: kept in fp32
    assert dsv3["non_expert_bytes"] == ((61 * mla + 3 * dense + 58 * shared + 2 * 129280 * 7168 + 7168) * 2
                                        + 58 * router * 4)


def test_preflight_text_names_the_kv_geometry(capsys):
    assert main(["preflight", "--model", str(PUBLISHED / "deepseek-v3"), "--memory-gib", "139",
                 "--link-gbps", "400"]) == 0
    text = capsys.readouterr().out
    assert "KV cache: 70,272 bytes per token (one latent row of 576 values per layer)" in text
    assert main(["preflight", "--model", str(PUBLISHED / "mixtral-8x7b"), "--memory-gib", "139",
                 "--link-gbps", "400"]) == 0
    assert "KV cache: 131,072 bytes per token (K and V of 8 KV heads x 128 per layer)" in capsys.readouterr().out


def test_a_quantized_checkpoint_is_sized_as_published(capsys):
    """Routed experts in the checkpoint's format (the host store, the slots, the link bound),
    everything else at the serving dtype; the text says which."""
    r = preflight(PUBLISHED / "deepseek-v3", memory_gib=139, link_bytes_per_s=50e9)
    assert r["expert_format"] == "fp8-block 128x128" and r["checkpoint_quantization"].startswith("fp8 (")
    plain = preflight(PUBLISHED / "qwen3-30b-a3b", memory_gib=139, link_bytes_per_s=5e9)
    int4 = preflight(PUBLISHED / "qwen3-30b-a3b-gptq-int4", memory_gib=139, link_bytes_per_s=5e9)
    assert int4["host_store_bytes"] / plain["host_store_bytes"] == pytest.approx(2_470_912 / 9_437_184)
    assert int4["non_expert_bytes"] == plain["non_expert_bytes"]        # dequantized at load
    # on CUDA the attention stays GPTQ int4 (keep_dense_quantized): per layer q [4096, 2048], k and v
    # [512, 2048], o [2048, 4096] = 18,874,368 weights, 37,748,736 bytes in bf16; int4 g128 holds
    # 1/2 + 1/256 (qzeros) + 1/64 (fp16 scales) a byte each, 9,805,824, plus g_idx 4 * (3 * 2048 + 4096)
    kept = preflight(PUBLISHED / "qwen3-30b-a3b-gptq-int4", memory_gib=139, link_bytes_per_s=5e9, device="cuda")
    assert kept["dense_kept_quantized"] and not int4["dense_kept_quantized"]
    assert plain["non_expert_bytes"] - kept["non_expert_bytes"] == 48 * (37_748_736 - 9_805_824 - 40_960)
    gpt_oss = preflight(PUBLISHED / "gpt-oss-20b", memory_gib=139, link_bytes_per_s=5e9, device="cuda")
    assert gpt_oss["non_expert_bytes"] == preflight(PUBLISHED / "gpt-oss-20b", memory_gib=139, link_bytes_per_s=5e9,
                                                    device="cuda", keep_dense_quantized=False)["non_expert_bytes"], \
        "gpt-oss leaves its attention unquantized (modules_to_not_convert): nothing else to keep"
    assert not gpt_oss["dense_kept_quantized"]
    # the link allows 9,437,184 / 2,470,912 = 3.8x the misses
    assert int4["max_miss_rate_for_target"] == pytest.approx(plain["max_miss_rate_for_target"] * 9_437_184 / 2_470_912)
    assert main(["preflight", "--model", str(PUBLISHED / "gpt-oss-20b"), "--memory-gib", "139",
                 "--link-gbps", "400"]) == 0
    assert ("the checkpoint is quantized (mxfp4 (mxfp4, not converted: model.layers.*.self_attn, "
            "model.layers.*.mlp.router, model.embed_tokens, lm_head)): routed experts are held and paged as "
            "mxfp4, every other weight is served at bfloat16") in capsys.readouterr().out
