"""Train the shipped checkpoint, models/tiny-moe/, on CPU from an offline corpus.

    python -m models.train_tiny_moe --out models/tiny-moe --steps 800 --seed 1234

Trains a byte-level BPE tokenizer, then a Qwen3-MoE (E=64 experts, top-4) on the
standard library's source mixed with chat-formatted copy and docstring examples,
writes the checkpoint in the HF layout (bf16 weights) and a README with the losses
and the routing-locality figures measured on held-out text.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine import corpus
from engine.checkpoint import save_checkpoint
from models.locality import layer_locality
from models.tiny_moe_model import TinyConfig, TinyMoe

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=corpus.SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    eot = tok.token_to_id(corpus.BOS_DOC)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(streams: list[torch.Tensor], weights: list[float], batch: int, seq: int,
                 gen: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        r = torch.rand((), generator=gen).item()
        s = streams[0] if r < weights[0] else streams[1]
        start = torch.randint(0, len(s) - seq - 1, (), generator=gen).item()
        rows.append(s[start:start + seq + 1])
    return torch.stack(rows)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model: TinyMoe, stream: torch.Tensor, seq: int, windows: int) -> float:
    model.eval()
    losses = []
    stride = max(seq, (len(stream) - seq - 1) // windows)
    for start in range(0, stride * windows, stride):
        chunk = stream[start:start + seq + 1].unsqueeze(0)
        logits = model(chunk[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def hf_config(cfg: TinyConfig, tok: Tokenizer) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": 0.02, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "use_cache": True, "use_sliding_window": False, "sliding_window": None,
        "bos_token_id": None, "eos_token_id": tok.token_to_id(corpus.IM_END),
        "pad_token_id": tok.token_to_id(corpus.BOS_DOC), "torch_dtype": "bfloat16",
    }


def write_tokenizer_files(out: Path, tok: Tokenizer) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
             for t in corpus.SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "eos_token": corpus.IM_END, "pad_token": corpus.BOS_DOC, "bos_token": None,
        "unk_token": None, "model_max_length": 2048, "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [tok.token_to_id(corpus.IM_END), tok.token_to_id(corpus.BOS_DOC)],
        "pad_token_id": tok.token_to_id(corpus.BOS_DOC), "do_sample": False}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tiny-moe")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--chat-share", type=float, default=0.45)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--locality-coef", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-from", default=None,
                    help="continue from a checkpoint this script wrote (its tokenizer is kept)")
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    train_texts, held_texts = corpus.read_split()
    chats = corpus.chat_examples(train_texts, 100000, args.seed)
    held_chats = corpus.chat_examples(held_texts, 500, args.seed + 1)
    if args.init_from:
        tok = Tokenizer.from_file(str(Path(args.init_from) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts + chats[:20000], TinyConfig.vocab_size)
    cfg = TinyConfig()
    code, chat = token_stream(tok, train_texts), token_stream(tok, chats)
    held = token_stream(tok, held_texts)
    print(f"corpus: {len(code)} code tokens, {len(chat)} chat tokens, {len(held)} held-out; "
          f"{time.time() - t0:.0f}s", flush=True)

    model = TinyMoe(cfg)
    random_locality = layer_locality(model, _windows(held, 512, 8))
    previous = None
    if args.init_from:
        model.load_hf(load_file(str(Path(args.init_from) / "model.safetensors")))
        previous = json.loads((Path(args.init_from) / "training_stats.json").read_text())
        random_locality = previous["random_init_locality"]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    ema = None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=args.warmup)
        batch = sample_batch([chat, code], [args.chat_share], args.batch, args.seq, gen)
        logits = model(batch[:, :-1])
        lm = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss = lm + args.aux_coef * model.aux_loss() + args.locality_coef * model.locality_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = lm.item() if ema is None else 0.95 * ema + 0.05 * lm.item()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step} loss {lm.item():.3f} ema {ema:.3f} aux {model.aux_loss().item():.3f} "
                  f"locality {model.locality_loss().item():.3f} {time.time() - t0:.0f}s", flush=True)
        if step % 100 == 99:
            hits = [round(r["lru16_hit_rate"], 2) for r in layer_locality(model, _windows(held, 256, 2))]
            model.train()
            print(f"  held-out LRU-16 hit rate per layer: {hits}", flush=True)

    train_loss = eval_loss(model, code, args.seq, 32)
    held_loss = eval_loss(model, held, args.seq, 32)
    held_chat_loss = eval_loss(model, token_stream(tok, held_chats), args.seq, 16)
    trained_locality = layer_locality(model, _windows(held, 512, 8))
    tensors = {k: v.to(torch.bfloat16) for k, v in model.state_dict_hf().items()}
    save_checkpoint(out, tensors, hf_config(cfg, tok))
    write_tokenizer_files(out, tok)
    stats = {"args": vars(args), "config": asdict(cfg), "final_ema_train_loss": ema,
             "train_loss": train_loss, "held_out_loss": held_loss, "held_out_chat_loss": held_chat_loss,
             "uniform_loss": math.log(cfg.vocab_size), "trained_locality": trained_locality,
             "random_init_locality": random_locality, "seconds": time.time() - t0,
             "tokens_seen": args.steps * args.batch * args.seq, "previous_stage": previous}
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps({k: v for k, v in stats.items() if "locality" not in k}, indent=2))


def _windows(stream: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    stride = (len(stream) - length) // count
    return [stream[i * stride:i * stride + length] for i in range(count)]


if __name__ == "__main__":
    main()
