"""Tokenizer (tokenizer.json through `tokenizers`), chat template (jinja2), and the incremental
detokenizer that keeps a request's output text as it grows.

A checkpoint without tokenizer.json but with a TikToken `tiktoken.model` (Kimi-K2: lines of
`<base64 token bytes> <rank>`) gets the same kind of `tokenizers` object built from it (as
transformers' TikTokenConverter builds one): a byte-level BPE whose ids are the ranks and whose
merges are every split of a token into two ranked halves, ordered by the token's rank; the
pre-tokenization pattern (tokenizer_config.json's "pat_str", else the one Kimi's
tokenization_kimi.py uses); the special tokens numbered after the ranks from
tokenizer_config.json's added_tokens_decoder, the gaps filled with `<|reserved_token_{id}|>`.

The chat template is where transformers looks for it: a `chat_template.jinja` file beside
tokenizer_config.json (what newer transformers save; it wins, as in transformers), else
tokenizer_config.json's `chat_template` (a string, or a list of named templates: "default").
It renders as transformers renders it: a sandbox with trim_blocks/lstrip_blocks, loop controls,
`raise_exception`, `strftime_now` and a `tojson` that does not escape HTML.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

REPLACEMENT = "\ufffd"   # what decoding shows for an incomplete (or invalid) UTF-8 sequence
MAX_PENDING_TOKENS = 8   # a UTF-8 character has at most 4 bytes: more pending ids than this are garbage
TEMPLATE_FILE = "chat_template.jinja"
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


class Tokenizer:
    def __init__(self, path: str | Path):
        root = Path(path)
        cfg_file = root / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        file, ranks = root / "tokenizer.json", root / TIKTOKEN_FILE
        kimi = False
        if file.is_file():
            self._tok = _HFTokenizer.from_file(str(file))
        elif ranks.is_file():
            kimi = _is_kimi(root, cfg)
            self._tok = tiktoken_tokenizer(ranks, tiktoken_pattern(root, cfg), cfg,
                                           reserved=KIMI_RESERVED if kimi else 0)
        else:
            raise FileNotFoundError(f"no tokenizer.json (nor a TikToken {TIKTOKEN_FILE}) in {root}")
        self.chat_template: str | None = chat_template(root, cfg)
        self.eos_token: str | None = _token_text(cfg.get("eos_token", KIMI_EOS if kimi else None))
        self.bos_token: str | None = _token_text(cfg.get("bos_token", KIMI_BOS if kimi else None))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers` object (from tokenizer.json, or built from tiktoken.model): what
        reads the tokenizer's spec or encodes off the GIL uses it, not tokenizer.json."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}]) with the checkpoint's template.

        Raises ValueError when the checkpoint has no template or a message is malformed.
        """
        if self._template is None:
            raise ValueError(f"this checkpoint has no chat template ({TEMPLATE_FILE}, or chat_template in "
                             f"tokenizer_config.json)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content'")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class IncrementalDetokenizer:
    """The text of a growing sequence of token ids, decoding only a few recent ids per token
    (as vLLM's `detokenize_incrementally`), so that a token costs the same at any output length.

        ids:  [ ...... committed ...... | context | pending ]
                                        ^prefix   ^read

    ids[:read] are committed: their text is final.  Each `push` decodes ids[prefix:] and drops
    the text of the context ids[prefix:read] (decoded when they were committed): the context
    gives decoders whose output depends on the previous token (a leading space) what they need.
    The new ids are committed unless their text ends in an incomplete character (U+FFFD): then
    they stay pending, and `length`/`slice` show them decoded as they are, exactly as decoding
    every id at once would (its result is the committed text plus the pending ids' text).  After
    MAX_PENDING_TOKENS pending ids they are committed as they are (their bytes cannot complete a
    character; only output that is not UTF-8 at all gets there).

    The committed text is kept as chunks plus a tail of at least `keep` characters, so appending
    and reading the last `keep` characters cost O(keep), not O(output).  `decode_calls` and
    `decoded_ids` count the tokenizer's work (tests bound them per token)."""

    def __init__(self, tokenizer: Tokenizer, keep: int = 4096):
        self.tokenizer, self.keep = tokenizer, keep
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self._prefix_len = 0            # len(decode(ids[prefix:read]))
        self._chunks: list[str] = []    # committed text before the tail
        self._tail, self._tail_start = "", 0
        self._pending = ""              # the text of ids[read:] (may end in U+FFFD)
        self.decode_calls = self.decoded_ids = 0

    def push(self, token: int) -> None:
        """Append one id and decode what it changes."""
        self.ids.append(token)
        text = self._decode(self.ids[self._prefix:])
        new = text[self._prefix_len:]
        if new.endswith(REPLACEMENT) and len(self.ids) - self._read < MAX_PENDING_TOKENS:
            self._pending = new
            return
        self._commit(new)
        self._prefix, self._read, self._pending = self._read, len(self.ids), ""
        self._prefix_len = len(self._decode(self.ids[self._prefix:self._read]))

    @property
    def length(self) -> int:
        """Characters of text (committed and pending)."""
        return self.committed + len(self._pending)

    @property
    def committed(self) -> int:
        """Characters of final text (the pending ids' text may still change)."""
        return self._tail_start + len(self._tail)

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end]: O(length of the result) when `start` lies in the last `keep`
        committed characters or after (every read of the stop checks), O(output) otherwise."""
        if start < self._tail_start:
            return self.text()[start:end]
        s, e = start - self._tail_start, (self.length if end is None else end) - self._tail_start
        n = len(self._tail)
        if e <= n:
            return self._tail[s:e]
        return self._tail[s:] + self._pending[max(0, s - n):e - n]

    def text(self) -> str:
        """The whole text (O(output): for the end of a request)."""
        if self._chunks:
            self._tail, self._tail_start = "".join(self._chunks) + self._tail, 0
            self._chunks = []
        return self._tail + self._pending

    def _commit(self, new: str) -> None:
        self._tail += new
        if len(self._tail) > 2 * self.keep:        # move all but the last `keep` into a chunk
            cut = len(self._tail) - self.keep
            self._chunks.append(self._tail[:cut])
            self._tail, self._tail_start = self._tail[cut:], self._tail_start + cut

    def _decode(self, ids: list[int]) -> str:
        self.decode_calls += 1
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids)


def chat_template(root: Path, cfg: dict[str, Any]) -> str | None:
    """The checkpoint's default chat template: `chat_template.jinja` in `root`, else
    tokenizer_config.json's (`cfg`) `chat_template`, a string or [{"name", "template"}] of which
    "default" is used.  None when there is none."""
    file = root / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


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
    if _is_kimi(root, cfg):
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
        content = _token_text(value) if isinstance(value, (str, dict)) else None
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


def _is_kimi(root: Path, cfg: dict[str, Any]) -> bool:
    """The checkpoint's tokenizer code is Kimi's: auto_map names tokenization_kimi (possibly as
    "repo--tokenization_kimi.Class"), or tokenization_kimi.py sits beside it."""
    named = _auto_tokenizer(cfg) or ""
    module = named.split("--")[-1].rsplit(".", 1)[0]
    return module == KIMI_CODE or (root / f"{KIMI_CODE}.py").is_file()


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(tok: str | dict[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(tok, dict):
        content = tok.get("content")
        return content if isinstance(content, str) else None
    return tok


def _raise(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)
