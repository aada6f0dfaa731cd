"""`tandem serve`: start the deployment, print one line once it is healthy, serve until
SIGINT or SIGTERM, then drain and exit 0."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from deploy.settings import ServeSettings


def serve(settings: ServeSettings) -> int:
    from deploy.launcher import Deployment
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    _on_signals(stop)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    deployment = Deployment(settings, say=say)
    try:
        deployment.start(on_ray_started=lambda: _on_signals(stop))   # Ray installs its own handlers
        if not stop.is_set():
            print(f"Tandem is serving {settings.name} at " + ", ".join(f"{u}/v1" for u in deployment.urls),
                  flush=True)
        while not stop.wait(0.5):   # a signal landing on one of Ray's threads runs its handler here
            pass
        say("tandem: draining")
    finally:
        deployment.stop()
    say("tandem: stopped")
    return 0


def _on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
