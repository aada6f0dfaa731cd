"""Multi-head latent attention (engine/models/mla.py): one layer against transformers'
DeepseekV3Attention (fp32), the absorbed path (serving) against the expanded one (reference)
over paged latent rows, what a page row holds, the KV bytes a token takes, and a whole
Kimi-K2-shaped model (one expert group, no q lora, the older rope_scaling spelling) against
transformers' generate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)

from engine import LLM, SamplingParams
from engine.attention import TorchAttention
from engine.config import SHIPPED_MODEL, ModelConfig
from engine.forward_batch import build_batch
from engine.models import deepseek_v3
from engine.models.decoder import StepContext
from engine.models.mla import MlaAttention, MlaDims, expanding_is_cheaper
from tests.parity import check_parity

PAGE = 4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny_config(**over) -> DeepseekV3Config:
    args = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
                max_position_embeddings=256, rope_parameters=YARN)
    cfg = DeepseekV3Config(**{**args, **over})
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(cfg: DeepseekV3Config, seed: int = 0) -> DeepseekV3Attention:
    torch.manual_seed(seed)
    att = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for name, p in att.named_parameters():
            p.normal_(1.0 if "layernorm" in name else 0.0, 0.2)
    return att


def engine_block(cfg: DeepseekV3Config, att: DeepseekV3Attention, absorbed: bool) -> MlaAttention:
    """The engine's block from HF's weights, through the family module's loading code."""
    mc = ModelConfig.from_dict(cfg.to_dict())
    t = {f"model.layers.0.self_attn.{k}": v.detach().clone() for k, v in att.state_dict().items()}
    block = deepseek_v3.attention_layer(mc, t, "model.layers.0.", deepseek_v3.make_rope(mc, "cpu"), absorbed)
    assert not t  # every tensor of the layer was used
    return block


def run(block: MlaAttention, kv: torch.Tensor, chunks: list[torch.Tensor], starts: list[int],
        tables: list[list[int]]) -> torch.Tensor:
    """One forward of the block for requests adding `chunks[b]` ([n_b, H]) at `starts[b]`."""
    batch = build_batch([[0] * len(c) for c in chunks], starts, tables, PAGE, "cpu")
    attention = TorchAttention(PAGE)
    ctx = StepContext(batch, attention, attention.plan(batch) if batch.is_decode else None, torch.float32, kv[None])
    with torch.no_grad():
        return block(torch.cat(chunks), kv, ctx)


def hf_outputs(cfg: DeepseekV3Config, att: DeepseekV3Attention, x: torch.Tensor) -> torch.Tensor:
    """HF's attention over a whole sequence x [n, H] (causal): [n, H]."""
    n = x.shape[0]
    pe = DeepseekV3RotaryEmbedding(cfg)(x[None], torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return att(x[None], pe, mask)[0][0]


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("over", [
    {},                                                                          # q lora, YaRN, interleaved
    {"attention_bias": True},                                                    # q_a / kv_a / o biases
    {"q_lora_rank": None, "attention_bias": True, "rope_parameters": DEFAULT_ROPE},  # q_proj, biases
    {"rope_interleave": False},                                                  # halves pairing
], ids=["q_lora-yarn", "q_lora-bias", "q_proj-bias-default_rope", "not_interleaved"])
def test_layer_matches_transformers(over, absorbed):
    """Two requests on scattered pages: a prefill of both, then three decode steps; every
    token's output equals HF's attention over the whole sequence."""
    cfg = tiny_config(**over)
    att = hf_attention(cfg)
    block = engine_block(cfg, att, absorbed)
    lens, tables = [7, 12], [[3, 1, 6, 0], [2, 5, 7, 4]]
    x = [torch.randn(n + 3, cfg.hidden_size) for n in lens]
    kv = torch.zeros(1, 8, PAGE, 1, block.dims.row)
    first = run(block, kv, [xs[:n] for xs, n in zip(x, lens)], [0, 0], tables)
    got = [[first[:lens[0]]], [first[lens[0]:]]]
    for step in range(3):
        out = run(block, kv, [xs[n + step:n + step + 1] for xs, n in zip(x, lens)], [n + step for n in lens], tables)
        got[0].append(out[:1])
        got[1].append(out[1:])
    for g, xs in zip(got, x):
        torch.testing.assert_close(torch.cat(g), hf_outputs(cfg, att, xs), atol=1e-5, rtol=0)


def test_page_row_holds_normed_latent_and_roped_key():
    """What a KV page stores per token: [kv_a_layernorm(latent) | rope(k_pe)], one row for all heads."""
    cfg = tiny_config()
    att = hf_attention(cfg)
    block = engine_block(cfg, att, absorbed=True)
    x = torch.randn(6, cfg.hidden_size)
    kv = torch.zeros(1, 4, PAGE, 1, block.dims.row)
    run(block, kv, [x], [0], [[2, 0]])
    rows = kv[0, [2, 0]].reshape(-1, block.dims.row)[:6]
    r = cfg.kv_lora_rank
    with torch.no_grad():
        latent, k_pe = att.kv_a_proj_with_mqa(x).split([r, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = DeepseekV3RotaryEmbedding(cfg)(x[None], torch.arange(6)[None])
        _, k_rot = apply_rotary_pos_emb_interleave(k_pe[None, None], k_pe[None, None], cos, sin)
        torch.testing.assert_close(rows[:, :r], att.kv_a_layernorm(latent), atol=1e-6, rtol=0)
        torch.testing.assert_close(rows[:, r:], k_rot[0, 0], atol=1e-6, rtol=0)


def test_absorbed_matches_expanded_over_cached_prefixes():
    """Wider heads; a prefill, a second chunk over the cached prefix beside a new request, then a
    decode batch of three: the absorbed path (latent MQA) and the expanded reference agree."""
    cfg = tiny_config(hidden_size=96, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32,
                      q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20)
    att = hf_attention(cfg, seed=1)
    blocks = [engine_block(cfg, att, absorbed) for absorbed in (True, False)]
    tables = [[5, 2, 9, 0, 11], [3, 7, 1, 12, 4], [8, 6, 10, 13, 14]]
    gen = torch.Generator().manual_seed(3)
    steps = [([10], [0], [0]), ([5, 13], [10, 0], [0, 1]), ([1, 1, 1], [15, 13, 0], [0, 1, 2])]
    outs: list[list[torch.Tensor]] = [[], []]
    kvs = [torch.zeros(1, 15, PAGE, 1, blocks[0].dims.row) for _ in blocks]
    for sizes, starts, reqs in steps:
        chunks = [torch.randn(n, cfg.hidden_size, generator=gen) for n in sizes]
        for i, block in enumerate(blocks):
            outs[i].append(run(block, kvs[i], chunks, starts, [tables[r] for r in reqs]))
    assert torch.equal(kvs[0], kvs[1])  # both paths cache the same rows
    diff = max((a - b).abs().max().item() for a, b in zip(*outs))
    assert diff < 1e-5, diff


def test_serving_takes_the_expanded_path_for_long_prefills_only():
    """absorbed=None (serving): a decode step and a short prefill run absorbed, a prefill long
    enough that expanding the latent costs fewer multiplies runs expanded (bit for bit the
    forced paths' results)."""
    cfg = tiny_config(hidden_size=96, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32,
                      q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20)
    att = hf_attention(cfg, seed=2)
    auto, absorbed, expanded = (engine_block(cfg, att, a) for a in (None, True, False))
    assert [expanding_is_cheaper(auto.dims, [q], [q]) for q in (70, 71)] == [False, True]  # 32*44/20 = 70.4
    table = list(range(30))
    gen = torch.Generator().manual_seed(5)
    for n, start in ((8, 0), (100, 0), (1, 100)):  # a short prefill, a long one, a decode step
        x = torch.randn(n, cfg.hidden_size, generator=gen)
        outs = [run(block, torch.zeros(1, 30, PAGE, 1, auto.dims.row), [x], [start], [table])
                for block in (auto, absorbed, expanded)]
        assert torch.equal(outs[0], outs[2] if n == 100 else outs[1]), n
        torch.testing.assert_close(outs[1], outs[2], atol=1e-5, rtol=0)


PUBLISHED = Path(__file__).resolve().parent.parent / "models" / "published"


def gqa_equivalent_bytes(cfg: ModelConfig, element_size: int) -> int:
    """Per token: K (dn + dr) and V (dv) of every head in every layer, as an expanded cache holds them."""
    raw = cfg.raw
    per_head = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"] + raw["v_head_dim"]
    return cfg.num_hidden_layers * cfg.num_attention_heads * per_head * element_size


def test_kv_bytes_per_token_latent_against_expanded():
    tiny = ModelConfig.from_dict({**tiny_config().to_dict(), "num_hidden_layers": 2})
    assert tiny.kv_geometry == (1, 1, 16 + 8)
    assert tiny.kv_bytes_per_token(4) == 2 * 24 * 4                              # 192 B in fp32
    assert gqa_equivalent_bytes(tiny, 4) == 2 * 4 * (16 + 8 + 12) * 4            # 1,152 B: 6x
    dsv3, kimi = (ModelConfig.from_path(PUBLISHED / name) for name in ("deepseek-v3", "kimi-k2"))
    for real in (dsv3, kimi):                                                    # 61 layers of 512 + 64
        assert real.kv_geometry == (1, 1, 576)
        assert real.kv_bytes_per_token(2) == 70_272                              # 68.6 KiB in bf16
        assert deepseek_v3.expert_bytes(real, 2) == 3 * 7168 * 2048 * 2          # 84 MiB per routed expert
        assert deepseek_v3.expected_tensors(real)                                # every field is supported
    assert gqa_equivalent_bytes(dsv3, 2) == 4_997_120                            # 128 heads: 4.77 MiB, 71x
    assert gqa_equivalent_bytes(kimi, 2) == 2_498_560                            # 64 heads: 2.38 MiB, 36x
    d = MlaDims.from_raw(dsv3.raw)   # prefill expands from 512 * 256 / (1088 - 320) = 170.7 queries
    assert [expanding_is_cheaper(d, [q], [q]) for q in (170, 171)] == [False, True]
    assert not expanding_is_cheaper(d, [1], [100_000])                          # a decode-sized chunk
    assert expanding_is_cheaper(d, [512], [8192])                                # a long chunk over a prefix


@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                         ("hidden_act", "gelu")])
def test_unsupported_variants_are_refused_by_name(field, value):
    cfg = ModelConfig.from_dict({**ModelConfig.from_path(PUBLISHED / "deepseek-v3").raw, field: value})
    with pytest.raises(ValueError, match=field):
        deepseek_v3.expected_tensors(cfg)


def write_kimi_shaped(path: Path) -> Path:
    """A tiny Kimi-K2-shaped checkpoint written by transformers: one expert group (n_group =
    topk_group = 1), q_proj instead of q lora, routed_scaling_factor 2.827, YaRN factor 32 past
    an original context of 16, no MTP layer; its config.json then respelled as Kimi-K2's is
    (model_type kimi_k2, `rope_scaling` with `type`, a top-level rope_theta), with the shipped
    tokenizer.  Returns the directory transformers reads (model_type deepseek_v3)."""
    torch.manual_seed(1)
    cfg = DeepseekV3Config(
        vocab_size=4096, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=12, num_experts_per_tok=3,
        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=512,
        eos_token_id=1, num_mtp_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 1.0,
                         "beta_slow": 1.0})
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    for f in SHIPPED_MODEL.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, path / f.name)
    raw = json.loads((path / "config.json").read_text())
    hf_dir = path.parent / (path.name + "-hf")
    shutil.copytree(path, hf_dir)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"], rope["type"] = rope.pop("rope_theta"), rope.pop("rope_type")
    for key in ("head_dim", "qk_head_dim"):
        raw.pop(key, None)
    raw.update(model_type="kimi_k2", rope_scaling=rope, scoring_func="sigmoid", topk_method="noaux_tc",
               moe_layer_freq=1)
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    (hf_dir / "config.json").write_text(json.dumps({**raw, "model_type": "deepseek_v3"}, indent=1))
    return hf_dir


def test_kimi_k2_shaped_model_matches_transformers(tmp_path):
    """Greedy tokens identical and every logprob within 1e-4 of transformers', on prompts that
    run past the original context (YaRN's interpolated frequencies and mscale at work)."""
    hf_dir = write_kimi_shaped(tmp_path / "kimi")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path / "kimi"), page_size=8)
    assert llm.pool.geometry == (1, 1, 16 + 8)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (1, 6, 17, 40)]
    try:
        check_parity(llm, hf, prompts)
        # a prompt sharing the last one's first 24 tokens: its prefill runs over cached latent pages
        shared = prompts[-1][:24] + [5, 6, 7, 8, 9]
        check_parity(llm, hf, [shared])
        out = llm.generate([shared], SamplingParams(max_tokens=1, temperature=0))[0]
        assert out.num_cached_tokens == 24
    finally:
        llm.pool.check_integrity()
        assert llm.pool.num_free == llm.pool.num_pages


@pytest.mark.parametrize("over", [
    {},
    {"q_lora_rank": None, "attention_bias": True},
    {"n_shared_experts": 2, "first_k_dense_replace": 0, "tie_word_embeddings": True},
    {"n_shared_experts": 0, "first_k_dense_replace": 2},
], ids=["q_lora", "q_proj-bias", "two_shared-no_dense-tied", "no_shared-two_dense"])
def test_expected_tensors_are_what_transformers_writes(over, tmp_path):
    from safetensors import safe_open
    cfg = tiny_config(intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=4,
                      num_experts_per_tok=2, n_group=2, topk_group=1, **over)
    DeepseekV3ForCausalLM(cfg).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    mc = ModelConfig.from_path(tmp_path)
    ignored = {name: shape for name, shape in written.items() if deepseek_v3.ignorable(mc, name)}
    assert all(0 in shape for shape in ignored.values())  # only n_shared_experts=0's empty MLPs
    assert deepseek_v3.expected_tensors(mc) == {n: s for n, s in written.items() if n not in ignored}
