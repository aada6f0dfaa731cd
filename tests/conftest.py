import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the suite runs eager unless a test asks for the compiled decode step (LLM(compile=True)); the
# processes it starts (workers, Ray actors, chaos runs) inherit this
os.environ.setdefault("TANDEM_COMPILE", "0")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from engine import LLM  # noqa: E402
from tests.checkpoints import write_random_checkpoint  # noqa: E402
from tests.kv_helpers import assert_engines_idle  # noqa: E402

_ENGINES: list[LLM] = []


@pytest.fixture(scope="session")
def shipped_llm() -> LLM:
    llm = LLM()
    _ENGINES.append(llm)
    return llm


@pytest.fixture(scope="session")
def random_ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("random-moe"))


@pytest.fixture(scope="session")
def random_llm(random_ckpt) -> LLM:
    llm = LLM(random_ckpt)
    _ENGINES.append(llm)
    return llm


@pytest.fixture(autouse=True)
def pools_idle_and_intact():
    """I6 after every test: every engine's pool is intact and fully free."""
    yield
    assert_engines_idle(_ENGINES)
