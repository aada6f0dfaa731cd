"""Runs a kernel test module's cases on CUDA in-process, or on a CPU in a child Python
under the Triton interpreter.

Triton decides when a kernel module is imported whether its kernels are interpreted, and
another test may already have imported triton in this process. So on a CPU every numeric
case runs in one child (the test module run as a script, which sets TRITON_INTERPRET=1
before importing triton); the pytest process never sets it, so it cannot leak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch


def kernel_case_tests(module_file: str, run_cases: Callable[[str], dict], names: list[str]):
    """The module-scoped results fixture and one parametrized test per case, for a kernel
    test module to bind: `case_results, test_kernel_matches_reference = kernel_case_tests(...)`."""

    @pytest.fixture(scope="module")
    def results() -> dict[str, str | None]:
        return case_results(module_file, run_cases)

    @pytest.mark.parametrize("name", names)
    def test_kernel_matches_reference(case_results: dict[str, str | None], name: str) -> None:
        assert case_results[name] is None, case_results[name]

    return results, test_kernel_matches_reference


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
