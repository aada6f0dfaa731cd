"""TikToken checkpoints (Kimi-K2: tiktoken.model + tokenizer_config.json, no tokenizer.json):
the `tokenizers` object built from the ranks encodes as TikToken does (checked against a
reference written here: the pattern through the `regex` module, then lowest-rank-first merges),
and as transformers' own TikToken conversion does; special tokens take their ids; what cannot be
known is refused by name."""

from __future__ import annotations

import base64
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import regex

from engine.config import SHIPPED_MODEL
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.tokenizer_tiktoken import KIMI_PATTERN, KIMI_PATTERN_PARTS, read_tiktoken_ranks

CORPUS = """The quick brown fox jumps over the lazy dog. I'm sure they'll say it's done, we've seen
HTTPServer and XMLHttpRequest calls: 12345 + 678 = 13023. naïve café résumé déjà vu.
中文English混合的句子。我们的模型服务很多用户，中文文本和English文本混在一起。
def hello_world():\n    return "hello, world!"  # comment\n\n\tindented tab
Überall größere Straßen; 日本語のテキスト、ひらがなとカタカナ。 emoji 🙂🚀 ok
""" * 3

TEXTS = [
    "hello world",
    "I'm sure they'll say it's done: XMLHttpRequest, camelCaseWords",
    "The lazy dog's HTTPServer returned 1234567 bytes.\n\n  done",
    "naïve café — déjà vu ü ß",
    "中文English混合",
    "我们的模型服务很多用户，中文文本",
    "日本語のテキスト ひらがな",
    "emoji 🙂🚀 and \t tabs\r\nCRLF   trailing   ",
    "",
    " ",
    "x" * 40,
]

SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
            6: "<|im_system|>", 7: "<|im_middle|>"}     # offsets after the ranks; 5 is a gap
KIMI_TEMPLATE = ("{%- for message in messages -%}"
                 "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
                 "{%- elif message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
                 "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
                 "{{ message['content'] }}<|im_end|>{%- endfor -%}"
                 "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
MESSAGES = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "你好, world"}]


def train(corpus: str, merges: int, seed: int = 0) -> list[bytes]:
    """A small TikToken vocabulary: the 256 bytes (in a shuffled order, so ids are not byte
    values) then `merges` most-frequent pairs of the corpus's pre-tokens, in rank order."""
    singles = list(range(256))
    random.Random(seed).shuffle(singles)
    vocab = [bytes([b]) for b in singles]
    known = set(vocab)
    words = Counter(tuple(bytes([b]) for b in w.encode()) for w in regex.findall(KIMI_PATTERN, corpus,
                                                                                  flags=regex.V1))
    for _ in range(merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if a + b not in known:
            vocab.append(a + b)
            known.add(a + b)
        merged: Counter[tuple[bytes, ...]] = Counter()
        for w, c in words.items():
            out: list[bytes] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return vocab


def reference_encode(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    """TikToken's encoding: special tokens matched first, the rest split by the pattern, each
    piece merged lowest-ranked adjacent pair first (leftmost on ties)."""
    ids: list[int] = []
    chunks = regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text) if specials else [text]
    for chunk in chunks:
        if chunk in specials:
            ids.append(specials[chunk])
            continue
        for piece in regex.findall(KIMI_PATTERN, chunk, flags=regex.V1):
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                scored = [(ranks.get(parts[i] + parts[i + 1], len(ranks)), i) for i in range(len(parts) - 1)]
                rank, i = min(scored)
                if rank == len(ranks):
                    break
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            ids.extend(ranks[p] for p in parts)
    return ids


def write_checkpoint(root: Path, vocab: list[bytes], cfg: dict | None = None, kimi: bool = True,
                     specials: dict[int, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(vocab))
    (root / "tiktoken.model").write_text(lines)
    n = len(vocab)
    specials = SPECIALS if specials is None else specials
    config: dict = {
        "added_tokens_decoder": {str(n + k): {"content": v, "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False, "special": True}
                                 for k, v in specials.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": KIMI_TEMPLATE,
        "tokenizer_class": "TikTokenTokenizer",
    }
    if kimi:
        config["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    config.update(cfg or {})
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def vocab() -> list[bytes]:
    return train(CORPUS, 300)


@pytest.fixture
def kimi(tmp_path: Path, vocab: list[bytes]) -> Path:
    return write_checkpoint(tmp_path / "kimi", vocab)


def special_ids(n: int) -> dict[str, int]:
    return {v: n + k for k, v in SPECIALS.items()}


def test_encodes_as_tiktoken_and_round_trips(kimi: Path, vocab: list[bytes]) -> None:
    tok = Tokenizer(kimi)
    ranks = {t: r for r, t in enumerate(vocab)}
    assert read_tiktoken_ranks(kimi / "tiktoken.model") == ranks
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference_encode(text, ranks, {}), text
        assert tok.decode(ids) == text
    # the merges learnt from the corpus are used: far fewer ids than bytes
    text = TEXTS[1] + TEXTS[4]
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_random_text_matches_the_reference(kimi: Path, vocab: list[bytes]) -> None:
    tok = Tokenizer(kimi)
    ranks = {t: r for r, t in enumerate(vocab)}
    rng = random.Random(1)
    alphabet = "abcdefgh ABC'sdl 0123 中文混合的 éüß\n\t.,!🙂"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert tok.encode(text) == reference_encode(text, ranks, {}), repr(text)


def test_merges_apply_in_rank_order(tmp_path: Path) -> None:
    singles = [bytes([b]) for b in range(256)]
    ab_first = Tokenizer(write_checkpoint(tmp_path / "ab", singles + [b"ab", b"bc"]))
    bc_first = Tokenizer(write_checkpoint(tmp_path / "bc", singles + [b"bc", b"ab"]))
    assert ab_first.encode("abc") == [256, ord("c")]
    assert bc_first.encode("abc") == [ord("a"), 256]
    # a lower-ranked merge deeper in the word wins over an earlier, higher-ranked one
    deep = Tokenizer(write_checkpoint(tmp_path / "deep", singles + [b"cd", b"ab", b"bcd"]))
    assert deep.encode("abcd") == [257, 256]        # cd (256) first, then ab (257); bcd never forms


def test_han_runs_split_from_letters(tmp_path: Path) -> None:
    # a token spanning Han and Latin bytes ("文E") ranks before "中文", but the pattern never lets it apply
    singles = [bytes([b]) for b in range(256)]
    zh, wen = "中".encode(), "文".encode()
    vocab = singles + [zh[:2], zh, wen[:2], wen, wen + b"E", zh + wen, b"En"]
    tok = Tokenizer(write_checkpoint(tmp_path / "han", vocab))
    ids = tok.encode("中文English")
    assert ids[0] == vocab.index(zh + wen) and vocab.index(wen + b"E") not in ids
    assert tok.decode(ids) == "中文English"
    assert tok._tok.pre_tokenizer is not None
    pieces = [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("中文English混合")]
    assert len(pieces) == 3


def test_special_tokens_take_their_ids(kimi: Path, vocab: list[bytes]) -> None:
    tok = Tokenizer(kimi)
    n = len(vocab)
    for text, i in special_ids(n).items():
        assert tok.token_to_id(text) == i and tok.encode(text) == [i]
    assert tok.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5       # the gap, filled as Kimi fills it
    assert tok.vocab_size == n + 256                                    # Kimi reserves 256 ids after the ranks
    assert tok.eos_token == "[EOS]" and tok.eos_token_id == n + 1 and tok.bos_token == "[BOS]"
    ranks = {t: r for r, t in enumerate(vocab)}
    text = "<|im_user|>user<|im_middle|>你好, world<|im_end|>"
    ids = tok.encode(text)
    assert ids == reference_encode(text, ranks, special_ids(n))
    assert ids[0] == n + 3 and ids[-1] == n + 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user你好, world"


def test_added_tokens_not_special_survive_decoding(tmp_path: Path, vocab: list[bytes]) -> None:
    n = len(vocab)
    root = write_checkpoint(tmp_path / "open", vocab)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"][str(n + 8)] = {"content": "<|open|>", "special": False}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(root)
    ids = tok.encode("a<|open|>b<|im_end|>")
    assert n + 8 in ids and n + 2 in ids
    assert tok.decode(ids) == "a<|open|>b"


def test_eos_from_config_and_kimi_defaults(tmp_path: Path, vocab: list[bytes]) -> None:
    n = len(vocab)
    im_end = Tokenizer(write_checkpoint(tmp_path / "a", vocab, {"eos_token": {"content": "<|im_end|>"}}))
    assert im_end.eos_token_id == n + 2
    root = write_checkpoint(tmp_path / "b", vocab)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    del cfg["eos_token"], cfg["bos_token"]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(root)          # tokenization_kimi.py's defaults
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token) == ("[EOS]", n + 1, "[BOS]")


def test_chat_template_renders_and_encodes(kimi: Path, vocab: list[bytes]) -> None:
    tok = Tokenizer(kimi)
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == ("<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
                      "<|im_user|>user<|im_middle|>你好, world<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tok.encode(prompt)
    n = len(vocab)
    assert ids[0] == n + 6 and ids[-1] == n + 7 and ids.count(n + 2) == 2


def test_incremental_detokenizer_over_multibyte_tokens(kimi: Path) -> None:
    tok = Tokenizer(kimi)
    text = "中文English混合 🙂 naïve"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    for i in ids:
        det.push(i)
    assert det.text() == text


def test_matches_transformers_conversion(kimi: Path, vocab: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' converter, with the ranks read here (the `tiktoken` package is not installed)
    from transformers.convert_slow_tokenizer import TikTokenConverter
    monkeypatch.setattr(TikTokenConverter, "load_tiktoken_bpe", staticmethod(lambda f: read_tiktoken_ranks(Path(f))))
    n = len(vocab)
    specials = [SPECIALS.get(k, f"<|reserved_token_{n + k}|>") for k in range(256)]
    hf = TikTokenConverter(vocab_file=str(kimi / "tiktoken.model"), pattern=KIMI_PATTERN,
                           extra_special_tokens=specials).converted()
    tok = Tokenizer(kimi)
    for text in [*TEXTS, "<|im_user|>hi<|im_end|>[EOS]"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


def test_matches_transformers_loading(tmp_path: Path, vocab: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers loads a tiktoken.model without remote code with its default (cl100k-like)
    pattern, numbering added_tokens_decoder after the ranks: the same pattern given as pat_str
    gives the same ids here, and the same eos."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter
    monkeypatch.setattr(TikTokenConverter, "load_tiktoken_bpe", staticmethod(lambda f: read_tiktoken_ranks(Path(f))))
    hf_root = write_checkpoint(tmp_path / "hf", vocab, {"tokenizer_class": "PreTrainedTokenizerFast"}, kimi=False)
    hf = AutoTokenizer.from_pretrained(str(hf_root))
    ours = write_checkpoint(tmp_path / "ours", vocab, {"pat_str": TikTokenConverter().pattern}, kimi=False)
    tok = Tokenizer(ours)
    n = len(vocab)
    assert tok.vocab_size == len(hf) == n + max(SPECIALS) + 1        # no Kimi reservation without Kimi's code
    assert tok.eos_token_id == hf.eos_token_id == n + 1
    for text in [*TEXTS, "<|im_user|>hi<|im_end|>[EOS]"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text


def test_tokenizer_json_still_wins(tmp_path: Path) -> None:
    root = tmp_path / "both"
    root.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / f, root / f)
    (root / "tiktoken.model").write_text("not a tiktoken file\n")
    shipped = Tokenizer(SHIPPED_MODEL)
    tok = Tokenizer(root)
    assert tok.encode(TEXTS[1]) == shipped.encode(TEXTS[1]) and tok.eos_token_id == shipped.eos_token_id


def test_kimi_code_file_is_recognised_and_checked(tmp_path: Path, vocab: list[bytes]) -> None:
    root = write_checkpoint(tmp_path / "code", vocab, kimi=False)
    parts = "\n".join(f'    r"""{p}""",' for p in KIMI_PATTERN_PARTS)
    (root / "tokenization_kimi.py").write_text(f'pat_str = "|".join([\n{parts}\n])\n')
    assert Tokenizer(root).vocab_size == len(vocab) + 256
    (root / "tokenization_kimi.py").write_text('pat_str = r"""\\p{L}+|\\s+"""\n')
    with pytest.raises(ValueError, match=r"tokenization_kimi\.py's pre-tokenization pattern is not.*pat_str"):
        Tokenizer(root)
    # the checkpoint's own pattern in tokenizer_config.json overrides
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**cfg, "pat_str": r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+"}))
    tok = Tokenizer(root)
    assert tok.decode(tok.encode("中文English 12")) == "中文English 12"


def test_refusals(tmp_path: Path, vocab: list[bytes]) -> None:
    singles = [bytes([b]) for b in range(256)]
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json \(nor a TikToken tiktoken\.model\)"):
        Tokenizer(tmp_path)
    other = write_checkpoint(tmp_path / "other", vocab, {"auto_map": {"AutoTokenizer": ["tok_other.Tok", None]}},
                             kimi=False)
    with pytest.raises(ValueError, match=r"tiktoken\.model is a TikToken tokenizer whose pre-tokenization pattern "
                                         r"is unknown.*tokenizer_config\.json has no \"pat_str\".*tok_other\.Tok"):
        Tokenizer(other)
    both = write_checkpoint(tmp_path / "both", vocab, {"pat_str": r"\s+", "pattern": r"\S+"})
    with pytest.raises(ValueError, match="pat_str and pattern must be one"):
        Tokenizer(both)
    bad = write_checkpoint(tmp_path / "bad", vocab, {"pat_str": "([unclosed"})
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer(bad)
    line = write_checkpoint(tmp_path / "line", vocab)
    with open(line / "tiktoken.model", "a") as f:
        f.write("@@@ 9\n")
    with pytest.raises(ValueError, match=rf"line {len(vocab) + 1}: not '<base64 token bytes> <rank>'"):
        Tokenizer(line)
    with pytest.raises(ValueError, match=r"1 single bytes have no rank \(first: 0x41\)"):
        Tokenizer(write_checkpoint(tmp_path / "bytes", [t for t in singles if t != b"A"]))
    gap = write_checkpoint(tmp_path / "gap", singles)
    (gap / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r * 2}\n"
                                                for r, t in enumerate(singles)))
    with pytest.raises(ValueError, match=r"the ranks are not 0\.\.255, each once"):
        Tokenizer(gap)
    dup = write_checkpoint(tmp_path / "dup", singles, specials={0: "[EOS]", 1: "[EOS]"})
    with pytest.raises(ValueError, match=r"special token '\[EOS\]' has two ids"):
        Tokenizer(dup)
    inside = write_checkpoint(tmp_path / "inside", singles, {"added_tokens_decoder": {"65": {"content": "<x>"}}})
    with pytest.raises(ValueError, match=r"added token '<x>' has id 65, which tiktoken\.model gives to b'A'"):
        Tokenizer(inside)


def test_backend_serialises_and_keeps_the_gateway_byte_bound(kimi: Path) -> None:
    """The gateway's prompt encoder reads the `tokenizers` spec: the built tokenizer
    round-trips through JSON and keeps every byte (so the byte-length bound applies)."""
    from tokenizers import Tokenizer as HFTokenizer

    from gateway.prompts import byte_bound
    tok = Tokenizer(kimi)
    spec = tok.backend.to_str()
    copy = HFTokenizer.from_str(spec)
    text = TEXTS[1] + TEXTS[4] + "<|im_end|>"
    assert copy.encode(text, add_special_tokens=False).ids == tok.encode(text)
    assert byte_bound(json.loads(spec), 16) == 16
