"""Independence checks for paged experts: every expert's bytes, as the checkpoint gave
them, must be what a slot holds after paging it in.

Fingerprints are taken from the per-expert checkpoint tensors before they are stacked,
so a stacking or repacking bug that mixes experts is caught too, not only a bad copy.
An expert's fingerprint covers all its tensors in the order w13, w2[, b13, b2] (biases:
gpt-oss), each laid out as the store holds it.
"""

from __future__ import annotations

import torch
import xxhash

from engine.experts.slots import ExpertSlots


class ExpertCheckError(RuntimeError):
    """A slot does not hold the bytes of the expert the slot map says it holds."""


def fingerprint(*tensors: torch.Tensor) -> int:
    """xxh3-64 over the raw bytes of the tensors, in order."""
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.intdigest()


def _slot_fingerprint(slots: ExpertSlots, slot: int) -> int:
    return fingerprint(*slots.slot(slot))


def check_independence(slots: ExpertSlots, layer: int) -> None:
    """Page every expert through one slot and compare it with its checkpoint fingerprint,
    then restore the slot.  Raises ExpertCheckError naming layer, expert and slot."""
    store = slots.store
    if len(store.fingerprints) != store.num_experts:
        raise ExpertCheckError(f"layer {layer}: no checkpoint fingerprints for its experts")
    probe = slots.num_slots - 1
    original = slots.expert_in[probe]
    for expert in range(store.num_experts):
        if fingerprint(*store.expert(expert)) != store.fingerprints[expert]:
            raise ExpertCheckError(f"layer {layer}: the host store's expert {expert} differs from the "
                                   "checkpoint (experts mixed while stacking?)")
        slot = slots.slot_of[expert]
        if slot < 0:
            slots.load([(expert, probe)])
            slot = probe
        slots.wait([slot])
        if _slot_fingerprint(slots, slot) != store.fingerprints[expert]:
            raise ExpertCheckError(f"layer {layer}: expert {expert} paged into slot {slot} does not match "
                                   "its checkpoint bytes")
    if slots.expert_in[probe] != original and original >= 0:
        slots.load([(original, probe)])
        slots.wait([probe])
    slots.counters.bytes_paged = 0


def verify_resident(slots: ExpertSlots, layer: int) -> None:
    """Compare every occupied slot with the fingerprint of the expert it claims to hold
    (catches a slot corrupted after start-up).  Raises ExpertCheckError."""
    for slot, expert in enumerate(slots.expert_in):
        if expert < 0:
            continue
        slots.wait([slot])
        if _slot_fingerprint(slots, slot) != slots.store.fingerprints[expert]:
            raise ExpertCheckError(f"layer {layer}: slot {slot} does not hold expert {expert}'s bytes")
