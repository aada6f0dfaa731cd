"""Runs a kernel test module's cases on CUDA in-process, or on a CPU in a child Python
under the Triton interpreter (TRITON_INTERPRET is read when triton is imported, so it is
set only in the child and never leaks into the pytest process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch


def case_results(module_file: str, run_cases: Callable[[str], dict]) -> dict[str, str | None]:
    """{case name: None when it passed, else the error}.  The module, run as a script,
    must print json.dumps(run_cases("cpu")) as its last line."""
    if torch.cuda.is_available():
        return run_cases("cuda")
    root = Path(module_file).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, module_file], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
