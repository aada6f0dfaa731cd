"""Where a checkpoint keeps its chat template: tokenizer_config.json (a string, or named
templates), or a `chat_template.jinja` file beside it (newer transformers); rendered as
transformers renders it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Repeat after me: <b>tandem-42</b> é"}]
SHIPPED = json.loads((SHIPPED_MODEL / "tokenizer_config.json").read_text())
# a template using what transformers' renderer adds: loop controls, tojson without HTML escapes
FANCY = ("{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}"
         "[{{ m.role }}]{{ m.content | tojson }}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant]{% endif %}")


def checkpoint(tmp_path: Path, config_template, file_template: str | None) -> Path:
    root = tmp_path / "tok"
    root.mkdir()
    shutil.copy(SHIPPED_MODEL / "tokenizer.json", root / "tokenizer.json")
    cfg = {k: v for k, v in SHIPPED.items() if k != "chat_template"}
    if config_template is not None:
        cfg["chat_template"] = config_template
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    if file_template is not None:
        (root / "chat_template.jinja").write_text(file_template, encoding="utf-8")
    return root


def hf_render(root: Path) -> str:
    hf = AutoTokenizer.from_pretrained(str(root))
    return hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("where", ["config", "file", "named", "both"])
def test_the_template_is_found_and_renders_like_transformers(tmp_path: Path, where: str) -> None:
    shipped = SHIPPED["chat_template"]
    named = [{"name": "tool_use", "template": FANCY}, {"name": "default", "template": shipped}]
    config, file = {"config": (shipped, None), "file": (None, shipped), "named": (named, None),
                    "both": (FANCY, shipped)}[where]   # the file wins, as in transformers
    root = checkpoint(tmp_path, config, file)
    tok = Tokenizer(root)
    assert tok.chat_template == shipped
    got = tok.apply_chat_template(MESSAGES)
    assert got == hf_render(root) and got.endswith("<|im_start|>assistant\n")


def test_transformers_renderer_extras(tmp_path: Path) -> None:
    root = checkpoint(tmp_path, None, FANCY)
    got = Tokenizer(root).apply_chat_template(MESSAGES)
    assert got == hf_render(root)
    assert '"Repeat after me: <b>tandem-42</b> é"' in got


def test_a_checkpoint_without_a_template_says_where_it_looked(tmp_path: Path) -> None:
    tok = Tokenizer(checkpoint(tmp_path, None, None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"no chat template \(chat_template.jinja, or chat_template in "
                                         r"tokenizer_config.json\)"):
        tok.apply_chat_template(MESSAGES)
