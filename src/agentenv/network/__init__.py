"""Network slots: per-sandbox namespace, tap, veth and nftables, and a pool of them."""

from agentenv.network.egress import OPEN, BadTarget, Egress, parse_targets
from agentenv.network.errors import NetworkError, NoFreeSlot
from agentenv.network.pool import SlotPool
from agentenv.network.slot import (
    Slot,
    adopted_slot,
    cleanup_stale,
    create_slot,
    destroy_slot,
    marked_slot,
    recover_slots,
    set_egress,
    slot_for,
)

__all__ = [
    "OPEN",
    "BadTarget",
    "Egress",
    "NetworkError",
    "NoFreeSlot",
    "Slot",
    "SlotPool",
    "adopted_slot",
    "cleanup_stale",
    "create_slot",
    "destroy_slot",
    "marked_slot",
    "parse_targets",
    "recover_slots",
    "set_egress",
    "slot_for",
]
