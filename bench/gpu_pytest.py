"""A pytest run as one `bench.gpu_check` step: a child process with a time limit, read back
from its JUnit XML (counts, each test's outcome and time, failures with their tracebacks, and the
figures the tests recorded with pytest's `record_testsuite_property`)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TRACE_CHARS = 4000      # per failed test, the end of its traceback


def property_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def recorded(root: ET.Element) -> dict[str, Any]:
    """The testsuite properties (`record_testsuite_property`), a name "group.figure" nested as
    {group: {figure: value}}; numbers as numbers."""
    out: dict[str, Any] = {}
    for suite in root.iter("testsuite"):
        for prop in suite.findall("./properties/property"):
            name, value = prop.get("name", ""), property_value(prop.get("value", ""))
            group, dot, figure = name.partition(".")
            if dot:
                out.setdefault(group, {})[figure] = value
            else:
                out[name] = value
    return out


def read_junit(path: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """(figures, failure details, skip reasons) from a JUnit XML file; figures["properties"]:
    what the tests recorded (see `recorded`), when they recorded anything."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    tests: dict[str, dict[str, Any]] = {}
    details: list[str] = []
    skips: list[str] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                text = (child.text or "")[-TRACE_CHARS:]
                details.append(f"{name}: {child.get('message', '')[:300]}\n{text}")
            elif child.tag == "skipped":
                outcome = "skipped"
                skips.append(child.get("message", ""))
        counts[outcome] += 1
        tests[name] = {"outcome": outcome, "seconds": round(float(case.get("time", 0) or 0), 2)}
    props = recorded(root)
    return {**counts, "tests": tests, **({"properties": props} if props else {})}, details, skips


def pytest_step(args: list[str], limit_s: float, env: dict[str, str], tmp: str, root: Path,
                name: str) -> dict[str, Any]:
    """Run `python -m pytest ARGS`; ok when something passed and nothing failed, skipped when
    every test skipped (the reason says why), failed otherwise (details: the tracebacks)."""
    xml = os.path.join(tmp, f"{name}.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"status": "failed", "reason": f"pytest timed out after {limit_s:.0f} s", "figures": {},
                "details": [out[-6000:]]}
    if not os.path.exists(xml):
        return {"status": "failed", "reason": f"pytest exited with {proc.returncode} and wrote no report",
                "figures": {}, "details": [(proc.stdout + proc.stderr)[-6000:]]}
    figures, details, skips = read_junit(xml)
    figures["exit_code"] = proc.returncode
    if figures["failed"] or figures["errors"] or proc.returncode not in (0, 5):
        bad = figures["failed"] + figures["errors"]
        return {"status": "failed", "reason": f"{bad} of {len(figures['tests'])} tests failed (pytest exit "
                f"{proc.returncode})", "figures": figures, "details": details or [proc.stdout[-6000:]]}
    if not figures["passed"]:
        why = sorted(set(skips))[:3] or ["pytest collected no tests"]
        return {"status": "skipped", "reason": f"all {figures['skipped']} tests skipped: " + "; ".join(why),
                "figures": figures, "details": []}
    return {"status": "ok", "reason": "", "figures": figures, "details": []}
