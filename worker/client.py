"""Driving one request through a decode worker and (disaggregated) a prefill worker, as the
gateway does: open `Generate`, take the reservation, send `Prefill` with it, stream tokens.

    for msg in generate(decode_channel, prefill_channel, "r1", "acme", ids, params):
        ...   # GenerateResponse: reservation, tokens..., then finish or error

The channels must carry credentials for the cluster secret (`kv_transfer.auth.channel(address,
secret)`): a worker refuses every call without them with UNAUTHENTICATED.

If prefill fails, the `Generate` call is cancelled at once (the decode worker frees the
reservation) and the stream ends with prefill's coded error.  Closing the iterator early
cancels both calls.

A migrated request continues with `generated` (the tokens already streamed) and `params.seed`
the seed of its first reservation; when those tokens already end it, the stream is one
`finish` message.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Iterator

import grpc

from engine.errors import ErrorCode
from engine.params import SamplingParams
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from worker.config import MAX_REQUEST_TIMEOUT_S
from worker.handoff import GenerateOrder


def generate(decode: grpc.Channel, prefill: grpc.Channel | None, request_id: str, tenant: str,
             ids: list[int], params: SamplingParams, timeout_s: float = MAX_REQUEST_TIMEOUT_S,
             cache_salt: str = "", generated: Sequence[int] = ()) -> Iterator[wpb.GenerateResponse]:
    order = GenerateOrder(request_id=request_id, tenant=tenant, prompt_token_ids=tuple(ids),
                          generated_token_ids=tuple(generated), params=params, cache_salt=cache_salt,
                          timeout_s=timeout_s)
    call = wpb_grpc.DecodeServiceStub(decode).Generate(order.to_proto(), timeout=timeout_s)
    failure: list[wpb.Error] = []
    pending = None
    try:
        first = next(call)
        if first.WhichOneof("kind") == "reservation" and prefill is not None:
            # before yielding: the caller may not pull
            pending = _prefill(prefill, order.prefill_order(first.reservation).to_proto(), timeout_s, call, failure)
        yield first
        if first.WhichOneof("kind") != "reservation":
            return
        for msg in call:
            yield msg
    except grpc.RpcError as e:
        if failure:
            yield wpb.GenerateResponse(error=failure[0])
        else:
            yield wpb.GenerateResponse(error=wpb.Error(code=ErrorCode.DECODE_UNAVAILABLE.value,
                                                       message=f"{e.code().name}: {e.details()}"))
    finally:
        call.cancel()
        if pending is not None and not pending.done():
            pending.cancel()


def _prefill(channel: grpc.Channel, request: wpb.PrefillRequest, timeout_s: float, call: grpc.Future,
             failure: list[wpb.Error]) -> grpc.Future:
    future = wpb_grpc.PrefillServiceStub(channel).Prefill.future(request, timeout=timeout_s)
    lock = threading.Lock()

    def done(f: grpc.Future) -> None:
        try:
            reply = f.result()
            error = None if reply.ok else reply.error
        except grpc.FutureCancelledError:
            return
        except grpc.RpcError as e:
            error = wpb.Error(code=ErrorCode.PREFILL_UNAVAILABLE.value, message=f"{e.code().name}: {e.details()}")
        if error is not None:
            with lock:
                failure.append(error)
            call.cancel()            # the decode worker frees the reservation at once

    future.add_done_callback(done)
    return future
