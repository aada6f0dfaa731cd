"""Where compiled artifacts live across restarts, and the start-up progress line.

Inductor's cache (its FX graph and autograd caches, the generated C++ or Triton code and the
built libraries) goes under a directory Tandem owns: `$TANDEM_CACHE_DIR/inductor`, default
`~/.cache/tandem/inductor` (Triton's kernel cache beside it, `.../triton`).  A directory the
operator set through TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR is kept.  A restart with the same
model, buckets, torch version and machine then loads the compiled graphs instead of building them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ENV_DIR = "TANDEM_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "tandem")


def use_cache_dir() -> Path:
    """Point inductor's (and Triton's) caches at Tandem's directory unless the operator chose
    one; returns inductor's.  Call before the first compilation (inductor reads the variable
    at every lookup).  Importing torch._dynamo already writes inductor's own default into the
    environment, so a value equal to that default counts as not chosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = cache_root()
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    path = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        # the cache holds libraries this process loads: private to its user
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError as e:
        raise RuntimeError(f"the compile cache directory {path} cannot be created ({e}); set {ENV_DIR} "
                           "to a writable directory, or start with --no-compile") from None
    if not writable:
        raise RuntimeError(f"the compile cache directory {path} is not writable; set {ENV_DIR} to a "
                           "writable directory, or start with --no-compile")
    return path


class Progress:
    """A one-line progress bar on stderr for the start-up compilation (a line per bucket when
    stderr is not a terminal, e.g. a log file)."""

    WIDTH = 24

    def __init__(self, what: str = "compiling the decode step") -> None:
        self.what, self.start = what, time.monotonic()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int, bucket: int) -> None:
        filled = self.WIDTH * done // total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        line = (f"{self.what}: [{bar}] {done}/{total} buckets (batch {bucket}), "
                f"{time.monotonic() - self.start:.1f} s")
        end = "\n" if done == total or not self.tty else ""
        sys.stderr.write(("\r" if self.tty else "") + line + end)
        sys.stderr.flush()
