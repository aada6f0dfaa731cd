"""The hand-off as two messages, each built once from its proto and passed whole: a
`GenerateOrder` carries everything a decode role needs to reserve for one request, a
`PrefillOrder` everything a prefill role needs to fill that reservation.

    caller:      wpb.GenerateRequest (the gateway, worker.client)
    decode D:    GenerateOrder.from_proto(msg) -> DecodeEngine.reserve(order)
                 -> wpb.Reservation {transfer_id, transfer_endpoint, seed, cached_tokens}
    caller:      worker.convert.prefill_request(..., res, ...) -> wpb.PrefillRequest
                 (the gateway, or a colocated worker for its own reservation)
    prefill P:   PrefillOrder.from_proto(msg) -> PrefillEngine.submit(order)
                 -> PushPlan -> TransferSender -> Commit

The decode worker's cached-prefix boundary keeps one name all the way: `cached_tokens`
(Reservation.cached_tokens, PrefillRequest.cached_tokens, PrefillOrder, PushPlan, TransferSender,
Commit.cached_tokens).  Only the page index it starts at is derived from it (`first_page`).
Both orders name a request's fields alike: request_id, tenant, prompt_token_ids,
generated_token_ids, params, cache_salt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.params import SamplingParams
from kv_transfer.frame import prompt_digest
from proto import worker_pb2 as wpb
from worker.convert import params_from_proto, prefill_request


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


@dataclass(frozen=True)
class GenerateOrder:
    """One decode reservation: what a Generate call asks of a decode worker."""
    request_id: str                         # the client's request id (the pool owner of its pages)
    tenant: str
    prompt_token_ids: tuple[int, ...]
    generated_token_ids: tuple[int, ...]    # a migrated request's tokens streamed before: reserved and
                                            # transferred with the prompt, replayed by its stop checks
    params: SamplingParams                  # the caller's; a migrated request's with its first seed
    cache_salt: str                         # the caller's (the role keys it with tenant and secret)
    timeout_s: float | None                 # how long the reservation waits for a frame (None: the
                                            # receiver's transfer timeout)

    @classmethod
    def from_proto(cls, msg: wpb.GenerateRequest) -> GenerateOrder:
        """The order of a Generate call (a timeout_s of 0: None).  Raises
        WorkerError(INVALID_REQUEST) naming a bad sampling parameter; the rest is checked by
        the role that takes it."""
        return cls(request_id=msg.request_id, tenant=msg.tenant, prompt_token_ids=tuple(msg.prompt_token_ids),
                   generated_token_ids=tuple(msg.generated_token_ids), params=params_from_proto(msg.params),
                   cache_salt=msg.cache_salt, timeout_s=msg.timeout_s or None)

    def with_seed(self, seed: int) -> GenerateOrder:
        """The order with `params.seed` set (the seed its reservation chose)."""
        return replace(self, params=replace(self.params, seed=seed))

    def prefill_request(self, res: wpb.Reservation) -> wpb.PrefillRequest:
        """The Prefill call that fills the reservation `res` made for this order
        (`worker.convert.prefill_request`)."""
        return prefill_request(self.request_id, self.tenant, list(self.prompt_token_ids), self.params, res,
                               self.cache_salt, self.generated_token_ids)
