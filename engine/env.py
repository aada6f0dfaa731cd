"""The process environment, read here: every variable Tandem's configuration takes from it.

    compile_default()   TANDEM_COMPILE       EngineConfig.compile's default (0: eager)
    cluster_secret()    TANDEM_CLUSTER_SECRET  a plain worker's or gateway's cluster secret, hex
    api_keys()          TANDEM_API_KEYS      tandem serve's API keys, KEY[:TENANT],...
    admin_keys()        TANDEM_ADMIN_KEYS    tandem serve's admin keys, KEY,...
    ray_auth_mode()     RAY_AUTH_MODE        whether Ray runs with token authentication
    openai_api_key()    OPENAI_API_KEY       tandem eval's API key when --api-key is not given

Secrets come from here rather than from flags, which `ps` shows.  (The compile cache's
directories, TANDEM_CACHE_DIR and torch's own, are read and set where the cache is made,
engine/compiled/cache.py.)  Importing this module loads nothing heavy."""

from __future__ import annotations

import os

__all__ = ["ADMIN_KEYS", "API_KEYS", "CLUSTER_SECRET", "COMPILE", "OPENAI_API_KEY", "RAY_AUTH_MODE", "admin_keys",
           "api_keys", "cluster_secret", "compile_default", "openai_api_key", "ray_auth_mode"]

COMPILE = "TANDEM_COMPILE"               # "0" makes eager the default (the test suite sets it)
CLUSTER_SECRET = "TANDEM_CLUSTER_SECRET"
API_KEYS = "TANDEM_API_KEYS"             # not shown by `ps`, unlike --api-key
ADMIN_KEYS = "TANDEM_ADMIN_KEYS"         # what /metrics and /v1/server_info require
RAY_AUTH_MODE = "RAY_AUTH_MODE"
OPENAI_API_KEY = "OPENAI_API_KEY"        # what OpenAI's own clients read too


def compile_default() -> bool:
    """Whether decode steps compile unless a config says otherwise: yes, unless TANDEM_COMPILE
    is 0 (or false, no, off).  Raises ValueError for another value."""
    value = os.environ.get(COMPILE, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{COMPILE}={os.environ[COMPILE]!r}: expected 1 (compiled decode steps, the "
                     f"default) or 0 (eager)")


def cluster_secret() -> bytes:
    """TANDEM_CLUSTER_SECRET as bytes (hex in the environment; empty when unset, which every
    config that needs one refuses).  Raises ValueError for a value that is not hex."""
    return bytes.fromhex(os.environ.get(CLUSTER_SECRET, ""))


def api_keys() -> str | None:
    """TANDEM_API_KEYS as it is (gateway/config.py `api_keys` reads it), or None when unset."""
    return os.environ.get(API_KEYS)


def admin_keys() -> str | None:
    """TANDEM_ADMIN_KEYS as it is, or None when unset."""
    return os.environ.get(ADMIN_KEYS)


def ray_auth_mode() -> str | None:
    """RAY_AUTH_MODE as it is, or None when unset."""
    return os.environ.get(RAY_AUTH_MODE)


def openai_api_key() -> str | None:
    """OPENAI_API_KEY as it is, or None when unset or empty."""
    return os.environ.get(OPENAI_API_KEY) or None
