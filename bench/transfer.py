"""KV transfer throughput: one transfer of a prompt's KV through each transport, against raw
memcpy, a raw loopback TCP socket and the checksum's rate, all measured in the same run.

    python -m bench.transfer [--json] [--repeats 7] [--message-kib 1024] [--device cuda]
                             [--geometry qwen3-30b-a3b --tokens 8192]

The shape (bench/transfer_shape.py) is by default a large model's cache: 32 layers, 8 KV
heads, head dim 128, bf16, 16-token pages, 512 prompt tokens = 64 MiB.  --geometry NAME takes
the layers, KV heads and head dim of models/published/NAME/config.json instead (bf16, 16-token
pages; MLA models are refused) for a prompt of --tokens, and adds `<t>_wire_s`: the median
seconds of one whole transfer through each transport, the wire time of that prompt's KV.
Frames carry 4 layers of one page, sent layer group by layer group as prefill would produce
them.  `local` runs in this process; `shm`, `nixl`, `grpc` and `tcp` cross to a second process
(bench/transfer_peer.py), one at a time.  A transfer's time runs from opening the stream to
the commit's acknowledgement, and its bytes are checked: the receiver's pages must hash as
the sender's.  Each figure is the median of --repeats (7, or 3 with --geometry).

grpc_gbps is gRPC over one stream, grpc4_gbps over four (TransportConfig(streams=4), each on
its own connection); grpc4_vs_grpc1 is their ratio.  grpc_tls_gbps: one stream over mutual TLS
(both sides holding certificates of one cluster CA, as `tandem serve` runs across nodes);
grpc_tls_vs_grpc is its rate over plaintext gRPC's.  grpc_bare_gbps: gRPC's own floor, the
payload in already-made messages of the transport's size through one bare stream (raw bytes,
no protobuf, checksums, credentials or pool writes; the transport's channel and server
options), with grpc_vs_bare (what the transport keeps of it) and grpc_bare_vs_tcp (what gRPC
keeps of the socket).  nixl_gbps: the NIXL transport (one-sided
writes into a staging ring the receiver registered, over UCX, cross-memory attach on one host;
the receiver verifies each frame there and copies it into its page), with nixl_vs_memcpy
and nixl_vs_shm; left out, saying why under "nixl", where the nixl extra cannot run.

Checksums.  checksum_gbps is xxh3-64 (the frame checksum) over the payload on one core, frame
by frame as the sender produces and hashes them.  <t>_checksum_share: the seconds the sender
spent on checksums and the tag plus the seconds the receiver spent verifying frames and
re-checksumming the destination pages, over the transfer's wall time.  For `local` one thread
does both; across processes the two sides run at once, so the sum counts time that overlaps.
checksum_overhead (and its _sender and _receiver halves) is gRPC's share, as earlier runs
reported it.

The bound.  `passes` lists the passes each transport makes over the payload bytes.  memcpy
reads and writes each byte once.  An shm receiver serves a transfer on one thread and must make
three passes, each required by the protocol: verify the frame's checksum where it lies in the
shared ring, copy it into the pool, and after the commit checksum the destination pages again.
The sender's gather and hash run at the same time on another core, and cost the receiver nothing
while they keep ahead of it.  With

    t_copy = nbytes / memcpy rate          t_hash = nbytes / checksum_gbps

the receiving core spends at least t_copy + 2 t_hash on one transfer (its copy, a strided
write into pages, is no faster than memcpy), so

    shm_vs_memcpy = t_copy / t_shm  <=  t_copy / (t_copy + 2 t_hash)  =  shm_bound_vs_memcpy

and shm_vs_bound is the share of that bound shm reaches.  (The verify reads the ring from the
last-level cache, where xxh3 may run faster than checksum_gbps's pass over the payload in
memory: the bound is, if anything, a little low.)

--device cuda: the sender's pool (and the `local` receiver's) lives on the GPU, so every frame
is staged through pinned host memory; `memcpy_gbps` is then the device-to-pinned-host copy of
the payload, and `host_memcpy_gbps` the host copy the bound is computed from.  The receiving
processes keep their pools in host memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
from typing import Any

import torch

from bench.report import emit
from bench.transfer_runs import (
    Source,
    Transfers,
    run_checksum,
    run_grpc_bare,
    run_grpc_tls,
    run_local,
    run_memcpy,
    run_nixl,
    run_remote,
    run_shm,
    run_tcp,
)
from bench.transfer_shape import KVShape
from kv_transfer.transport import TransportConfig
from kv_transfer.transport.nixl_agent import unavailable

NO_NIXL = unavailable()      # None where the nixl extra is installed and runs

_GATHER = "gather: copy the frame out of the pool's pages"
_HASH = "hash: xxh3 of the frame"
_VERIFY = "verify: xxh3 of the frame where the transport left it"
_WRITE = "write: copy the frame into the pool's pages"
_RECHECK = "re-check: xxh3 of the destination pages after the commit"
_GRPC_SEND = [f"{_GATHER}, into a new bytes object", _HASH, "join: copy a message's frames into one bytes object",
              "gRPC: copy the message into its slices", "kernel: copy into the socket"]
_GRPC_RECV = ["kernel: copy out of the socket", "gRPC: copy the message's slices into one bytes object",
              _VERIFY, _WRITE, _RECHECK]
PASSES: dict[str, dict[str, Any]] = {   # what each transport does to every payload byte, in order
    "memcpy": {"copy": ["read and write each byte once"]},
    "local": {"sender": [f"{_GATHER}, into a reused staging buffer", _HASH],
              "receiver": [f"{_VERIFY} (the staging buffer)", _WRITE, _RECHECK],
              "threads": "one: the sender's thread runs the receiver"},
    "shm": {"sender": [f"{_GATHER}, into the shared ring", _HASH],
            "receiver": [f"{_VERIFY} (the ring, mapped)", _WRITE, _RECHECK],
            "threads": "one per side, in two processes"},
    "nixl": {"sender": [f"{_HASH}, where it lies in the pool (registered with the sending agent)",
                        "NIXL write: UCX copies the frame from the pool into the receiver's staging ring "
                        "(cma on one host)"],
             "receiver": [f"{_VERIFY} (the staging ring, which only this connection's writes reach)", _WRITE,
                          _RECHECK],
             "threads": "one per side, in two processes"},
    "grpc": {"sender": _GRPC_SEND, "receiver": _GRPC_RECV,
             "threads": "the sender's, gRPC's own on both sides, the receiver's handler"},
    "grpc_bare": {"sender": _GRPC_SEND[-2:], "receiver": _GRPC_RECV[:2]},
    "grpc_tls": {"sender": [*_GRPC_SEND[:-1], "TLS: encrypt", _GRPC_SEND[-1]],
                 "receiver": [_GRPC_RECV[0], "TLS: decrypt", *_GRPC_RECV[1:]]},
}
UNITS = {"*_gbps": "GB/s (1e9 bytes/s)", "*_wire_s": "seconds", "payload_mib": "MiB (2^20 bytes)",
         "kib_per_token, frame_kib": "KiB (2^10 bytes)",
         "*_checksum_share, checksum_overhead*": "share of one transfer's wall time",
         "*_vs_*, shm_bound_vs_memcpy": "ratio of two rates"}


def machine() -> dict[str, Any]:
    model = platform.processor()
    if not model and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"cpus": os.cpu_count(), "processor": model or "unknown", "platform": platform.platform()}


def measure(device: str, repeats: int, config: TransportConfig, extras: bool = True,
            shape: KVShape = KVShape(), geometry: str | None = None) -> dict[str, Any]:
    """Every figure of the module doc for `shape` (`extras`: raw TCP and gRPC over TLS too;
    `geometry`: the published model it was read from, and then the wire times)."""
    src = Source.build(shape, device)
    payload = src.payload()                          # [payload_bytes] uint8, frame after frame
    seconds = {"memcpy": run_memcpy(payload, repeats, device)}
    if device != "cpu":
        seconds["host_memcpy"] = run_memcpy(payload, repeats)
    seconds["checksum"] = run_checksum(payload, shape, repeats)
    del payload
    one = dataclasses.replace(config, streams=1)
    if extras:
        seconds["tcp"] = run_tcp(src, repeats)
        seconds["grpc_bare"] = run_grpc_bare(src, one, repeats)
    transfers = {"local": run_local(src, one, repeats), "shm": run_shm(src, one, repeats),
                 "grpc": run_remote("grpc", src, one, repeats),
                 "grpc4": run_remote("grpc", src, dataclasses.replace(config, streams=4), repeats)}
    if NO_NIXL is None:
        transfers["nixl"] = run_nixl(src, one, repeats)
    if extras:
        transfers["grpc_tls"] = run_grpc_tls(src, one, repeats)
    seconds.update((name, t.seconds) for name, t in transfers.items())
    r: dict[str, Any] = {
        "payload_mib": shape.payload_bytes / 2**20, "shape": dataclasses.asdict(shape), "geometry": geometry,
        "kib_per_token": shape.bytes_per_token / 1024, "frames": sum(1 for _ in shape.frames()),
        "frame_kib": max(shape.frame_nbytes(l0, l1, n) for l0, l1, _, n in shape.frames()) / 1024,
        "units": UNITS, "device": device, "machine": machine(), "message_kib": config.message_bytes >> 10,
        "repeats": repeats, "nixl": NO_NIXL or "measured"}
    r.update(rates(shape.payload_bytes, seconds))
    r.update(checksum_shares(transfers))
    r["passes"] = PASSES
    r.update(shm_bound(r))
    if geometry is not None:
        r.update({f"{name}_wire_s": statistics.median(seconds[name]) for name in ("tcp", *transfers)
                  if name in seconds})
    return r


def rates(nbytes: int, seconds: dict[str, list[float]]) -> dict[str, float]:
    """`<name>_gbps` of every run, and the ratios between them."""
    r = {f"{name}_gbps": nbytes / statistics.median(times) / 1e9 for name, times in seconds.items()}
    r["grpc4_vs_grpc1"] = r["grpc4_gbps"] / r["grpc_gbps"]
    if "tcp_gbps" in r:
        r["grpc_vs_tcp"] = r["grpc_gbps"] / r["tcp_gbps"]
    if "grpc_bare_gbps" in r:
        r["grpc_vs_bare"] = r["grpc_gbps"] / r["grpc_bare_gbps"]
        r["grpc_bare_vs_tcp"] = r["grpc_bare_gbps"] / r["tcp_gbps"]
    if "grpc_tls_gbps" in r:
        r["grpc_tls_vs_grpc"] = r["grpc_tls_gbps"] / r["grpc_gbps"]
    r["shm_vs_memcpy"] = r["shm_gbps"] / r["memcpy_gbps"]
    if "nixl_gbps" in r:
        r["nixl_vs_memcpy"] = r["nixl_gbps"] / r["memcpy_gbps"]
        r["nixl_vs_shm"] = r["nixl_gbps"] / r["shm_gbps"]
    return r


def checksum_shares(transfers: dict[str, Transfers]) -> dict[str, float]:
    r = {f"{name}_checksum_share": t.checksum_share() for name, t in transfers.items()}
    grpc = transfers["grpc"]
    r["checksum_overhead"] = r["grpc_checksum_share"]
    r["checksum_overhead_sender"] = grpc.checksum_share(receiver=False)
    r["checksum_overhead_receiver"] = grpc.checksum_share(sender=False)
    return r


def shm_bound(r: dict[str, Any]) -> dict[str, float]:
    """The module doc's bound: per byte, t_copy / (t_copy + 2 t_hash), from this run's rates."""
    t_copy = 1 / r.get("host_memcpy_gbps", r["memcpy_gbps"])
    t_hash = 1 / r["checksum_gbps"]
    bound = t_copy / (t_copy + 2 * t_hash)
    return {"shm_bound_vs_memcpy": bound, "shm_vs_bound": r["shm_gbps"] * t_copy / bound}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=None, help="transfers per figure (7, or 3 with --geometry)")
    ap.add_argument("--message-kib", type=int, default=TransportConfig.message_bytes >> 10)
    ap.add_argument("--device", default="cpu", help="where the sender's KV pool lives (cpu, cuda)")
    ap.add_argument("--geometry", help="a published model's KV geometry: models/published/NAME/config.json")
    ap.add_argument("--tokens", type=int, default=KVShape.tokens, help="prompt tokens (default %(default)s)")
    args = ap.parse_args()
    try:
        shape = KVShape.from_published(args.geometry, args.tokens) if args.geometry else KVShape(tokens=args.tokens)
    except ValueError as e:
        ap.error(str(e))
    repeats = args.repeats or (3 if args.geometry else 7)
    torch.set_num_threads(1)
    config = TransportConfig(message_bytes=args.message_kib << 10)
    emit(measure(args.device, repeats, config, shape=shape, geometry=args.geometry), args.json)


if __name__ == "__main__":
    main()
