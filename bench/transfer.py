"""KV transfer throughput: one 64 MiB transfer through each transport, against raw memcpy
and a raw loopback TCP socket measured in the same run.

    python -m bench.transfer [--json] [--repeats 7] [--streams 1] [--message-kib 1024] [--device cuda]

The shape is a large model's cache (bench/transfer_shape.py: 32 layers, 8 KV heads, head
dim 128, bf16, 16-token pages, 512 prompt tokens = 64 MiB), sent in frames of 4 layers of
one page as prefill would produce them.  `local` runs in this process; `shm`, `grpc` and
`tcp` cross to a second process (bench/transfer_peer.py; the runs are bench/transfer_runs.py).
A transfer's time runs from opening the stream to the commit's acknowledgement, and its bytes
are checked: the receiver's pages must hash as the sender's.  Each figure is the median of
`--repeats`.

--device cuda: the sender's pool (and the `local` receiver's) lives on the GPU, so every frame
is staged through pinned host memory; `memcpy_gbps` is then the device-to-pinned-host copy of
the payload.  The receiving processes keep their pools in host memory.

grpc_tls_gbps: the same gRPC transfer over mutual TLS (both sides holding certificates of one
cluster CA, as `tandem serve` runs across nodes); grpc_tls_vs_grpc is its rate over plaintext
gRPC's, both measured in this run.

checksum_overhead: time spent on checksums and tags (sender checksums + the receiver's
verification and post-commit re-checksum, summed although the two processes run at the
same time) as a share of the gRPC transfer's wall time.  Rates are GB/s (10^9 bytes/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import torch

from bench.report import emit
from bench.transfer_runs import Source, run_grpc_tls, run_local, run_memcpy, run_remote, run_shm, run_tcp
from bench.transfer_shape import KVShape
from kv_transfer.transport import TransportConfig


def measure(device: str, repeats: int, config: TransportConfig, extras: bool = True,
            shape: KVShape = KVShape()) -> dict[str, Any]:
    """Every rate of the module doc (`extras`: raw TCP and gRPC over TLS too)."""
    src = Source.build(shape, device)
    nbytes = shape.payload_bytes
    gbps = lambda times: nbytes / statistics.median(times) / 1e9  # noqa: E731
    r: dict[str, Any] = {"payload_mib": nbytes / 2**20, "shape": dataclasses.asdict(shape),
                         "units": "GB/s (1e9 bytes/s)", "device": device, "streams": config.streams,
                         "message_kib": config.message_bytes >> 10, "repeats": repeats}
    r["memcpy_gbps"] = gbps(run_memcpy(src.payload(), repeats, device))
    if extras:
        r["tcp_gbps"] = gbps(run_tcp(src, repeats))
    r["local_gbps"] = gbps(run_local(src, config, repeats).seconds)
    r["shm_gbps"] = gbps(run_shm(src, config, repeats).seconds)
    grpc = run_remote("grpc", src, config, repeats)
    r["grpc_gbps"] = gbps(grpc.seconds)
    if extras:
        r["grpc_tls_gbps"] = gbps(run_grpc_tls(src, config, repeats).seconds)
        r["grpc_tls_vs_grpc"] = r["grpc_tls_gbps"] / r["grpc_gbps"]
        r["grpc_vs_tcp"] = r["grpc_gbps"] / r["tcp_gbps"]
    r["checksum_overhead"] = grpc.checksum_share()
    r["checksum_overhead_sender"] = grpc.checksum_share(receiver=False)
    r["checksum_overhead_receiver"] = grpc.checksum_share(sender=False)
    r["shm_vs_memcpy"] = r["shm_gbps"] / r["memcpy_gbps"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--streams", type=int, default=TransportConfig.streams)
    ap.add_argument("--message-kib", type=int, default=TransportConfig.message_bytes >> 10)
    ap.add_argument("--device", default="cpu", help="where the sender's KV pool lives (cpu, cuda)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = TransportConfig(streams=args.streams, message_bytes=args.message_kib << 10)
    emit(measure(args.device, args.repeats, config), args.json)


if __name__ == "__main__":
    main()
