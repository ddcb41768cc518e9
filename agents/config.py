"""The agents' one configuration object."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.agents.anchors import AnchorConfig
from kvgate.agents.predictor import Prior
from kvgate.agents.ttl import PinPolicy


@dataclass(frozen=True)
class AgentConfig:
    pins: PinPolicy = PinPolicy()
    # Tool durations before any is observed (per tool, until its own observations outweigh it).
    prior: Prior = Prior()
    # A program with no request for this long is forgotten (its stored context stays, unpinned).
    idle_s: float = 3600.0
    # How fast KV reads back from the tier below memory, when there is one.
    reload_bytes_per_s: float = 1e9
    # KVCOMM: agents reuse the KV of messages other agents read or wrote, offset by anchors.
    kvcomm: bool = True
    anchors: AnchorConfig = AnchorConfig()
