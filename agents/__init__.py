"""Agent programs (Continuum): KV pinned across tool calls for a predicted time-to-live, and
program-level FCFS (the runtime's `queue_order="program"`); and KVCOMM's anchor pool, with which
one agent reuses the KV of text another agent read or wrote."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ANY": ".predictor",
    "AgentConfig": ".config",
    "Anchor": ".anchors",
    "AnchorConfig": ".config",
    "AnchorPool": ".anchors",
    "Conversations": ".conversations",
    "Costs": ".costs",
    "Expirer": ".programs",
    "PINS": ".ttl",
    "PinPolicy": ".ttl",
    "Predictor": ".predictor",
    "Prior": ".predictor",
    "Program": ".programs",
    "ProgramQueue": ".queue",
    "Programs": ".programs",
    "Turn": ".programs",
    "benefit": ".ttl",
    "context_key": ".programs",
    "decide": ".ttl",
    "tool_return": ".programs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    """Names load on first use, so that a light process (a proxy front) imports no torch through here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
