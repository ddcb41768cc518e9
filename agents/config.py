"""The agents' one configuration object."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.agents.predictor import Prior
from kvgate.agents.ttl import PinPolicy


@dataclass(frozen=True)
class AnchorConfig:
    max_anchors: int = 32
    max_bytes: int = 1 << 30
    # The gate: the nearest anchor's relative feature distance must not exceed this. Measured on
    # SmolLM2-135M: the same text under two prefixes ~0.05, two GSM8K questions 0.34-0.55, a
    # question and a line of code 0.67-0.73.
    max_distance: float = 0.6
    # Softmax temperature over distances: lower leans on the nearest anchor alone.
    temperature: float = 0.05

    def __post_init__(self) -> None:
        if self.max_anchors < 1 or self.max_bytes < 1 or self.max_distance < 0 or self.temperature <= 0:
            raise ValueError("max_anchors and max_bytes must be at least 1, max_distance >= 0 and temperature > 0")

    @property
    def grace(self) -> int:
        """How many of the newest anchors eviction spares while others are left to evict."""
        return max(1, self.max_anchors // 4)


@dataclass(frozen=True)
class AgentConfig:
    pins: PinPolicy = PinPolicy()
    # Tool durations before any is observed (per tool, until its own observations outweigh it).
    prior: Prior = Prior()
    # A program with no request for this long is forgotten (its stored context stays, unpinned).
    idle_s: float = 3600.0
    # Bounds on what callers grow: programs remembered, tenants and tools per tenant whose tool
    # durations are learnt (the least recently seen go first).
    max_programs: int = 65536
    max_tenants: int = 1024
    max_tools: int = 256
    # Programs in flight, per context memory holds (agents/flight.py): a new program waits for room
    # past that many (0: no limit); one waiting on a tool counts until the tool is this late. What a
    # `Programs` given no door of its own builds one with (the simulator's); a server's is the engine's.
    in_flight: float = 0.0
    in_flight_linger_s: float = 60.0
    # How fast KV reads back from the tier below memory, when there is one.
    reload_bytes_per_s: float = 1e9
    # Programs without markup (agents/conversations.py): requests that resend an answered turn's
    # history continue its program; so many answered turns are remembered for it.
    implicit_programs: bool = True
    conversations: int = 4096

    def __post_init__(self) -> None:
        if self.in_flight < 0 or self.in_flight_linger_s <= 0:
            raise ValueError("in_flight must not be negative and in_flight_linger_s must be positive")
