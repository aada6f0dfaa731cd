"""The hand-off as two messages, each built once and passed whole: a `GenerateOrder` carries
everything a decode role needs to reserve for one request, a `PrefillOrder` everything a
prefill role needs to fill that reservation.  Each message is built from its order in one
place (`to_proto`) and read back in one (`from_proto`).

    caller:      GenerateOrder(...).to_proto() -> wpb.GenerateRequest (the gateway, worker.client)
    decode D:    GenerateOrder.from_proto(msg) -> DecodeEngine.reserve(order)
                 -> wpb.Reservation {transfer_id, transfer_endpoint, seed, cached_tokens}
    caller:      order.prefill_order(reservation).to_proto() -> wpb.PrefillRequest
                 (the gateway, or worker.client; a colocated worker submits the PrefillOrder
                 for its own reservation as it is, with no proto in between)
    prefill P:   PrefillOrder.from_proto(msg) -> PrefillEngine.submit(order)
                 -> PushPlan -> TransferSender -> Commit

The decode worker's cached-prefix boundary keeps one name all the way: `cached_tokens`
(Reservation.cached_tokens, PrefillRequest.cached_tokens, PrefillOrder, PushPlan, TransferSender,
Commit.cached_tokens).  Only the page index it starts at is derived from it (`first_page`).
Both orders name a request's fields alike, as their protos do: request_id, tenant,
prompt_token_ids, generated_token_ids, params, cache_salt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from engine.params import SamplingParams
from kv_transfer.frame import prompt_digest
from proto import worker_pb2 as wpb
from worker.convert import params_from_proto, params_to_proto


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

    @cached_property
    def digest(self) -> bytes:
        """prompt_digest(prompt + generated): binds the transfer's tokens.  Hashed when first
        read (the push), so an order refused on admission never pays for it."""
        return prompt_digest(self.prompt_token_ids + self.generated_token_ids, len(self.generated_token_ids))

    @classmethod
    def from_proto(cls, msg: wpb.PrefillRequest) -> PrefillOrder:
        """The order of a Prefill call.  Raises WorkerError(INVALID_REQUEST) naming a bad
        sampling parameter; the rest is checked by the role that takes it."""
        return cls(request_id=msg.request_id, tenant=msg.tenant, prompt_token_ids=tuple(msg.prompt_token_ids),
                   generated_token_ids=tuple(msg.generated_token_ids), params=params_from_proto(msg.params),
                   cache_salt=msg.cache_salt, transfer_id=msg.transfer_id, decode_endpoint=msg.decode_endpoint,
                   cached_tokens=msg.cached_tokens)

    def to_proto(self) -> wpb.PrefillRequest:
        """The Prefill call of this order (what `from_proto` reads back)."""
        return wpb.PrefillRequest(request_id=self.request_id, tenant=self.tenant,
                                  prompt_token_ids=self.prompt_token_ids, generated_token_ids=self.generated_token_ids,
                                  params=params_to_proto(self.params), cache_salt=self.cache_salt,
                                  transfer_id=self.transfer_id, decode_endpoint=self.decode_endpoint,
                                  cached_tokens=self.cached_tokens)


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
                                            # receiver's transfer timeout; 0 on the wire)

    @classmethod
    def from_proto(cls, msg: wpb.GenerateRequest) -> GenerateOrder:
        """The order of a Generate call (a timeout_s of 0: None).  Raises
        WorkerError(INVALID_REQUEST) naming a bad sampling parameter; the rest is checked by
        the role that takes it."""
        return cls(request_id=msg.request_id, tenant=msg.tenant, prompt_token_ids=tuple(msg.prompt_token_ids),
                   generated_token_ids=tuple(msg.generated_token_ids), params=params_from_proto(msg.params),
                   cache_salt=msg.cache_salt, timeout_s=msg.timeout_s or None)

    def to_proto(self) -> wpb.GenerateRequest:
        """The Generate call of this order (a timeout_s of None: 0, what `from_proto` reads back)."""
        return wpb.GenerateRequest(request_id=self.request_id, tenant=self.tenant,
                                   prompt_token_ids=self.prompt_token_ids, generated_token_ids=self.generated_token_ids,
                                   params=params_to_proto(self.params), cache_salt=self.cache_salt,
                                   timeout_s=self.timeout_s or 0.0)

    def prefill_only_order(self) -> PrefillOrder:
        """This order as a prefill-only one (params.max_tokens 0: the prompt's logprobs, no
        reservation, nothing pushed)."""
        return PrefillOrder(request_id=self.request_id, tenant=self.tenant, prompt_token_ids=self.prompt_token_ids,
                            generated_token_ids=(), params=self.params, cache_salt=self.cache_salt,
                            transfer_id=b"", decode_endpoint="", cached_tokens=0)

    def with_seed(self, seed: int) -> GenerateOrder:
        """The order with `params.seed` set (the seed its reservation chose); itself when its
        params already carry that seed (they are not checked again)."""
        return self if self.params.seed == seed else replace(self, params=replace(self.params, seed=seed))

    def prefill_order(self, res: wpb.Reservation) -> PrefillOrder:
        """The prefill that fills the reservation `res` made for this order: the order's request,
        with the seed `res` chose (prefill's first token and the decode stream continue one
        sampler), its transfer and its cache boundary `cached_tokens` (prefill sends the pages
        from there on).  Params that already carry that seed (a colocated worker's own
        reservation, a migrated request's) are passed as they are, not checked again."""
        params = self.with_seed(res.seed).params
        return PrefillOrder(request_id=self.request_id, tenant=self.tenant, prompt_token_ids=self.prompt_token_ids,
                            generated_token_ids=self.generated_token_ids, params=params, cache_salt=self.cache_salt,
                            transfer_id=res.transfer_id, decode_endpoint=res.transfer_endpoint,
                            cached_tokens=res.cached_tokens)
