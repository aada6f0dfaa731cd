"""Parity with transformers' Qwen3MoeForCausalLM (fp32): identical greedy tokens and
per-step logprobs within 1e-4, on the shipped checkpoint and on a random one of a
different shape (GQA 4:1, tied embeddings, a dense layer)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.parity import check_parity

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    \"\"\"A simple stack.\"\"\"\n",
    "<|im_start|>user\nRepeat after me: blue kettle 42<|im_end|>\n<|im_start|>assistant\n",
    "for i in range(10):",
    "# Return the absolute path of the file\n",
    "x",
    "raise ValueError(",
]


@pytest.fixture(scope="module")
def shipped_hf(shipped_llm):
    return AutoModelForCausalLM.from_pretrained(shipped_llm.config.model, dtype=torch.float32).eval()


def test_shipped_checkpoint_matches_transformers(shipped_llm, shipped_hf):
    check_parity(shipped_llm, shipped_hf, PROMPTS)


def test_random_checkpoint_of_another_shape_matches_transformers(random_llm, random_ckpt):
    hf = AutoModelForCausalLM.from_pretrained(random_ckpt, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings and random_llm.model_config.mlp_only_layers == (1,)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (1, 5, 9, 16, 17, 33, 50, 64)]
    check_parity(random_llm, hf, prompts)
