"""TikToken checkpoints (Kimi-K2 ships `tiktoken.model`, lines of `<base64 token bytes> <rank>`,
and no tokenizer.json): the `tokenizers` object built from one, as transformers'
TikTokenConverter builds it: a byte-level BPE whose ids are the ranks and whose merges are
every split of a token into two ranked halves, ordered by the token's rank; the
pre-tokenization pattern (tokenizer_config.json's "pat_str", else the one Kimi's
tokenization_kimi.py uses); the special tokens numbered after the ranks from
tokenizer_config.json's added_tokens_decoder, the gaps filled with `<|reserved_token_{id}|>`.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

TIKTOKEN_FILE = "tiktoken.model"
PATTERN_KEYS = ("pat_str", "pattern")   # where tokenizer_config.json may carry a TikToken pattern

# Kimi's pre-tokenization pattern: TikTokenTokenizer.pat_str in tokenization_kimi.py of
# moonshotai/Kimi-K2-Instruct (the remote code its tokenizer_config.json's auto_map names), as
# vendored with that file (e.g. troy12x/quasar-kimi, tokenization_kimi.py) and quoted by
# llama.cpp's unicode.cpp (unicode_regex_split_custom_kimi_k2) and splintr's Kimi tests.  Han
# runs split off first; `&&[^\p{Han}]` (a class intersection: Oniguruma, which `tokenizers`
# uses, reads it as tiktoken's fancy-regex does) keeps the letter branches off Han.
KIMI_PATTERN_PARTS = (
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
)
KIMI_PATTERN = "|".join(KIMI_PATTERN_PARTS)
KIMI_CODE = "tokenization_kimi"       # the module auto_map names (and the file beside it)
KIMI_RESERVED = 256                   # tokenization_kimi.py: num_reserved_special_tokens after the ranks
KIMI_BOS, KIMI_EOS = "[BOS]", "[EOS]"  # its defaults when tokenizer_config.json names none


def tiktoken_pattern(root: Path, cfg: dict[str, Any]) -> str:
    """The pre-tokenization pattern of the TikToken tokenizer in `root`: tokenizer_config.json's
    ("pat_str" or "pattern"), else Kimi's when the checkpoint's tokenizer code is Kimi's.
    ValueError, naming what is missing, when neither: a guessed pattern would encode prompts
    into ids the model was not trained on, silently."""
    given = {k: cfg[k] for k in PATTERN_KEYS if k in cfg}
    if given:
        if len(set(map(str, given.values()))) > 1 or not all(isinstance(v, str) and v for v in given.values()):
            raise ValueError(f"{root / 'tokenizer_config.json'}: {' and '.join(given)} must be one non-empty "
                             f"pattern string")
        return str(next(iter(given.values())))
    if is_kimi(root, cfg):
        code = root / f"{KIMI_CODE}.py"
        if code.is_file():
            text = code.read_text(encoding="utf-8", errors="replace")
            missing = [p for p in KIMI_PATTERN_PARTS if p not in text]
            if missing:
                raise ValueError(f"{code}'s pre-tokenization pattern is not the one Kimi-K2 ships (it lacks "
                                 f"{missing[0]!r}): put the pattern as \"pat_str\" in tokenizer_config.json")
        return KIMI_PATTERN
    named = _auto_tokenizer(cfg) or "none"
    raise ValueError(f"{root / TIKTOKEN_FILE} is a TikToken tokenizer whose pre-tokenization pattern is unknown: "
                     f"{root / 'tokenizer_config.json'} has no \"pat_str\" and its tokenizer code ({named}) is "
                     f"not Kimi's ({KIMI_CODE}.py, the one whose pattern Tandem knows); put the pattern as "
                     f"\"pat_str\" in tokenizer_config.json")


def tiktoken_tokenizer(file: Path, pattern: str, cfg: dict[str, Any], reserved: int = 0) -> _HFTokenizer:
    """A `tokenizers` byte-level BPE equal to the TikToken encoding of `file` (ranks), `pattern`
    and the special tokens of tokenizer_config.json (`cfg`): added_tokens_decoder's ids at or
    past the ranks, gaps (and up to `reserved` ids after the ranks) `<|reserved_token_{id}|>`."""
    ranks = read_tiktoken_ranks(file)
    n = len(ranks)
    byte_text = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_text[x] for x in b)

    # Merges: every split of a token into two ranked halves, ordered by the token's rank (ties:
    # by the halves' ranks), so that BPE merges the lowest-ranked pair first, as TikToken does.
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    bpe = models.BPE({text(t): r for t, r in ranks.items()}, [(text(m[3]), text(m[4])) for m in merges],
                     fuse_unk=False, ignore_merges=True)
    tok = _HFTokenizer(bpe)
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    except Exception as e:  # tokenizers raises its own exception type for a bad pattern
        raise ValueError(f"the pre-tokenization pattern for {file} does not compile: {e}") from e
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()

    # one at a time, in id order: `tokenizers` numbers added tokens as they come
    for i, (t, is_special) in enumerate(_special_tokens(file, cfg, ranks, reserved)):
        added = AddedToken(t, special=is_special, normalized=False)
        if is_special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(t) != n + i:
            raise ValueError(f"special token {t!r} got id {tok.token_to_id(t)} instead of {n + i} ({file})")
    return tok


def read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """{token bytes: rank} of a TikToken file (`<base64 bytes> <rank>` a line).  The ranks must
    be 0..n-1 (they are the ids) and hold the 256 single bytes (so that any text encodes)."""
    ranks: dict[bytes, int] = {}
    for no, line in enumerate(file.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("not two fields")
            tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{file} line {no}: not '<base64 token bytes> <rank>' ({e})") from e
        if tok in ranks:
            raise ValueError(f"{file} line {no}: token {tok!r} ranked twice")
        ranks[tok] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{file}: the ranks are not 0..{len(ranks) - 1}, each once")
    if missing := [b for b in range(256) if bytes([b]) not in ranks]:
        raise ValueError(f"{file}: {len(missing)} single bytes have no rank (first: {missing[0]:#04x}); a byte-level "
                         f"BPE needs all 256")
    return ranks


def _special_tokens(file: Path, cfg: dict[str, Any], ranks: dict[bytes, int],
                    reserved: int) -> list[tuple[str, bool]]:
    """The added tokens in id order from len(ranks), with whether decoding skips them:
    added_tokens_decoder's (ids below len(ranks) must be the ranked token itself; "special"
    as it says, true when absent: TikToken matches them all in text), the rest
    `<|reserved_token_{id}|>` (special)."""
    n = len(ranks)
    by_rank = {r: t for t, r in ranks.items()}
    named: dict[int, tuple[str, bool]] = {}
    decoder = cfg.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"tokenizer_config.json beside {file}: added_tokens_decoder must be an object")
    for key, value in decoder.items():
        content = token_text(value) if isinstance(value, (str, dict)) else None
        if not content or not str(key).isdigit():
            raise ValueError(f"tokenizer_config.json beside {file}: added_tokens_decoder[{key!r}] is not "
                             f"an id with a token")
        i = int(key)
        if i < n:
            if by_rank[i] != content.encode("utf-8"):
                raise ValueError(f"tokenizer_config.json beside {file}: added token {content!r} has id {i}, "
                                 f"which {file.name} gives to {by_rank[i]!r}")
            continue
        named[i] = (content, not isinstance(value, dict) or value.get("special", True) is not False)
    end = max([n + reserved, *(i + 1 for i in named)])
    out = [named.get(i, (f"<|reserved_token_{i}|>", True)) for i in range(n, end)]
    texts = [t for t, _ in out]
    if len(set(texts)) != len(texts):
        dup = next(t for t in texts if texts.count(t) > 1)
        raise ValueError(f"tokenizer_config.json beside {file}: special token {dup!r} has two ids")
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable bytes stand for themselves, the others for
    the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _auto_tokenizer(cfg: dict[str, Any]) -> str | None:
    """The tokenizer class tokenizer_config.json's auto_map names ("module.Class"), if any."""
    entry = (cfg.get("auto_map") or {}).get("AutoTokenizer") if isinstance(cfg.get("auto_map"), dict) else None
    if isinstance(entry, list):
        entry = next((e for e in entry if isinstance(e, str)), None)
    return entry if isinstance(entry, str) else None


def is_kimi(root: Path, cfg: dict[str, Any]) -> bool:
    """The checkpoint's tokenizer code is Kimi's: auto_map names tokenization_kimi (possibly as
    "repo--tokenization_kimi.Class"), or tokenization_kimi.py sits beside it."""
    named = _auto_tokenizer(cfg) or ""
    module = named.split("--")[-1].rsplit(".", 1)[0]
    return module == KIMI_CODE or (root / f"{KIMI_CODE}.py").is_file()


def token_text(tok: str | dict[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(tok, dict):
        content = tok.get("content")
        return content if isinstance(content, str) else None
    return tok
