"""`tandem serve` started as a subprocess the way the README says, driven by the `openai`
client, then stopped the way systemd and container runtimes stop it, SIGTERM to its whole
process group: the local Ray it started is in a session of its own and lives on until the
deployment has drained, so it exits 0, says it drained, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from gateway.server import _free_port
from tests.gateway_helpers import connection


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if any(k in line for k in ("ray::", "raylet", "gcs_server"))]


def test_tandem_serve_answers_then_drains_on_sigterm_to_its_process_group(tmp_path):
    assert not ray_processes(), "Ray processes from elsewhere are running"
    port = _free_port("127.0.0.1")
    tandem = Path(sys.executable).parent / "tandem"
    log = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([str(tandem), "serve", "--port", str(port), "--kv-cache-tokens", "4096",
                             "--drain-grace-s", "20"], stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("Tandem is serving tiny-moe at http://127.0.0.1:"), (line, log.seek(0), log.read())
        url = line.split()[-1]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        r = client.chat.completions.create(model="tiny-moe", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Repeat after me: blue kettle"}])
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1
        # a stream in flight when SIGTERM arrives ends with its tokens or an explicit error
        conn = connection(url.rsplit("/v1", 1)[0])
        conn.request("POST", "/v1/completions", body='{"model": "tiny-moe", "prompt": "x", "max_tokens": 64, '
                     '"ignore_eos": true, "stream": true}', headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        os.killpg(proc.pid, signal.SIGTERM)          # the driver and everything in its group
        body = resp.read().decode()
        assert body.rstrip().endswith("data: [DONE]"), body      # finished within the grace period
        assert proc.wait(timeout=90) == 0
        log.seek(0)
        err = log.read()
        assert "tandem: draining" in err and "tandem: drained:" in err and "tandem: stopped" in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    end = time.monotonic() + 20
    while ray_processes() and time.monotonic() < end:
        time.sleep(0.5)
    assert not ray_processes(), ray_processes()
