"""A rogue client: a process of its own, without the cluster secret, that calls every worker
RPC and the KV transfer service directly, as anyone who can reach a worker's port could.

    python -m chaos.rogue '{"decode": [{"address": "127.0.0.1:5001",
                                        "transfer": "grpc://127.0.0.1:5002"}],
                            "prefill": ["127.0.0.1:5003"], "prompt": [1, 2, 3], "tenant": "acme"}'

prints one JSON line: a list of {"target", "call", "credentials", "code"} (`code`: the status
code name the call ended with, "OK" when it was served).  Every call is made twice: with no
credentials, and with credentials made from a wrong secret.  The calls are ones that would
change state if served: a Generate that reserves pages, a Prefill that computes and pushes,
an Abort, a Push carrying a Hello and a frame.  A shm:// transfer endpoint is left out (its
socket admits only the worker's own uid; `tests/test_shm_security.py` covers it).
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable
from typing import Any

import grpc

from kv_transfer.auth import channel
from kv_transfer.frame import PROTOCOL_VERSION, new_transfer_id
from kv_transfer.transport import framing, grpc_stream
from proto import kv_transfer_pb2 as pb
from proto import kv_transfer_pb2_grpc as pb_grpc
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc

TIMEOUT_S = 10.0
CREDENTIALS = ("none", "wrong_secret")
Call = tuple[str, Callable[[grpc.Channel], object]]


def open_channel(target: str, credentials: str) -> grpc.Channel:
    """A channel whose calls carry no credentials, or credentials of a secret not the cluster's."""
    if credentials == "none":
        return grpc.insecure_channel(target)
    return channel(target, secrets.token_bytes(32))


def code_of(call: Callable[[grpc.Channel], object], ch: grpc.Channel) -> str:
    try:
        call(ch)
    except grpc.RpcError as e:
        return str(e.code().name)
    return "OK"


def decode_calls(plan: dict[str, Any]) -> list[Call]:
    params = wpb.SamplingParams(max_tokens=4, top_k=-1, logprobs=-1)
    req = wpb.GenerateRequest(request_id=f"rogue-{secrets.token_hex(4)}", tenant=plan["tenant"],
                              prompt_token_ids=plan["prompt"], params=params, timeout_s=5)
    return [
        ("Generate", lambda ch: list(wpb_grpc.DecodeServiceStub(ch).Generate(req, timeout=TIMEOUT_S))),
        ("Abort", lambda ch: wpb_grpc.DecodeServiceStub(ch).Abort(
            wpb.AbortRequest(request_id=req.request_id, transfer_id=new_transfer_id()), timeout=TIMEOUT_S)),
        ("Stats", lambda ch: wpb_grpc.DecodeServiceStub(ch).Stats(wpb.StatsRequest(), timeout=TIMEOUT_S)),
    ]


def prefill_calls(plan: dict[str, Any], endpoint: str) -> list[Call]:
    params = wpb.SamplingParams(max_tokens=4, top_k=-1, logprobs=-1, has_seed=True, seed=1)
    req = wpb.PrefillRequest(request_id=f"rogue-{secrets.token_hex(4)}", tenant=plan["tenant"],
                             prompt_token_ids=plan["prompt"], params=params, decode_endpoint=endpoint,
                             transfer_id=new_transfer_id())
    return [
        ("Prefill", lambda ch: wpb_grpc.PrefillServiceStub(ch).Prefill(req, timeout=TIMEOUT_S)),
        ("Stats", lambda ch: wpb_grpc.PrefillServiceStub(ch).Stats(wpb.StatsRequest(), timeout=TIMEOUT_S)),
    ]


def transfer_calls(plan: dict[str, Any]) -> list[Call]:
    tid = new_transfer_id()
    hello = pb.Hello(versions=[PROTOCOL_VERSION], sender="rogue", transfer_id=tid)
    header = pb.FrameHeader(protocol_version=PROTOCOL_VERSION, transfer_id=tid, request_id="rogue",
                            tenant=plan["tenant"], ownership_tag=bytes(16), seq=0, layer_start=0,
                            layer_end=1, page_index=0, first_token=0, num_tokens=1, dtype="bfloat16")
    messages = [framing.encode(pb.PushMessage(hello=hello)),
                framing.encode(pb.PushMessage(frame=pb.Frame(header=header)), [bytes(64)])]

    def push(ch: grpc.Channel) -> object:
        call = ch.stream_unary(grpc_stream.PUSH, request_serializer=None,
                               response_deserializer=pb.PushReply.FromString)
        return call(iter(messages), timeout=TIMEOUT_S)
    return [
        ("Handshake", lambda ch: pb_grpc.KvTransferStub(ch).Handshake(hello, timeout=TIMEOUT_S)),
        ("Push", push),
    ]


def attack(plan: dict[str, Any]) -> list[dict[str, str]]:
    """Every call of the plan, with each kind of credentials; what each ended with."""
    targets: list[tuple[str, list[Call]]] = []
    endpoint = ""
    for d in plan["decode"]:
        targets.append((d["address"], decode_calls(plan)))
        if str(d.get("transfer") or "").startswith("grpc://"):
            endpoint = endpoint or d["transfer"]
            targets.append((d["transfer"].removeprefix("grpc://"), transfer_calls(plan)))
    for address in plan["prefill"]:
        targets.append((address, prefill_calls(plan, endpoint or "grpc://127.0.0.1:1")))
    out = []
    for credentials in CREDENTIALS:
        for target, calls in targets:
            with open_channel(target, credentials) as ch:
                for name, call in calls:
                    out.append({"target": target, "call": name, "credentials": credentials,
                                "code": code_of(call, ch)})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(attack(json.loads(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
