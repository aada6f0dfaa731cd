"""The prefill hand-off as one message: a `PrefillOrder` carries everything a prefill role needs
to fill one decode reservation.  It is built once, from the `PrefillRequest` proto, and passed
whole:

    decode D:    Generate -> wpb.Reservation {transfer_id, transfer_endpoint, seed, cached_tokens}
    caller:      worker.convert.prefill_request(..., res, ...) -> wpb.PrefillRequest
                 (the gateway, or a colocated worker for its own reservation)
    prefill P:   PrefillOrder.from_proto(msg) -> PrefillEngine.submit(order)
                 -> PushPlan -> TransferSender -> Commit

The decode worker's cached-prefix boundary keeps one name all the way: `cached_tokens`
(Reservation.cached_tokens, PrefillRequest.cached_tokens, PrefillOrder, PushPlan, TransferSender,
Commit.cached_tokens).  Only the page index it starts at is derived from it (`first_page`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.params import SamplingParams
from kv_transfer.frame import prompt_digest
from proto import worker_pb2 as wpb
from worker.convert import params_from_proto


@dataclass(frozen=True)
class PrefillOrder:
    """One prefill for a decode worker's reservation."""
    request_id: str                         # the client's request id (what the ownership tag binds)
    tenant: str
    prompt_token_ids: tuple[int, ...]
    generated_token_ids: tuple[int, ...]    # a migrated request's tokens generated before: their KV
                                            # is computed and pushed with the prompt's
    params: SamplingParams                  # with the seed the reservation chose
    cache_salt: str                         # the caller's (the role keys it with tenant and secret)
    transfer_id: bytes
    decode_endpoint: str                    # the reservation's transfer endpoint
    cached_tokens: int                      # the decode worker's cached prefix: pages before it are not sent
    digest: bytes                           # prompt_digest(prompt + generated): binds the transfer's tokens

    @classmethod
    def from_proto(cls, msg: wpb.PrefillRequest) -> PrefillOrder:
        """The order of a Prefill call.  Raises WorkerError(INVALID_REQUEST) naming a bad
        sampling parameter; the rest is checked by the role that takes it."""
        ids, generated = tuple(msg.prompt_token_ids), tuple(msg.generated_token_ids)
        return cls(request_id=msg.request_id, tenant=msg.tenant, prompt_token_ids=ids,
                   generated_token_ids=generated, params=params_from_proto(msg.params),
                   cache_salt=msg.cache_salt, transfer_id=msg.transfer_id, decode_endpoint=msg.decode_endpoint,
                   cached_tokens=msg.cached_tokens, digest=prompt_digest(ids + generated, len(generated)))
