"""Agent programs (Continuum): KV pinned across tool calls for a predicted time-to-live, and
program-level FCFS (the runtime's `queue_order="program"`); and KVCOMM's anchor pool, with which
one agent reuses the KV of text another agent read or wrote."""

from kvgate.agents.anchors import Anchor, AnchorConfig, AnchorPool
from kvgate.agents.config import AgentConfig
from kvgate.agents.costs import Costs, EngineCosts
from kvgate.agents.predictor import ANY, Predictor, Prior
from kvgate.agents.programs import Expirer, Program, Programs, context_key, tool_return
from kvgate.agents.ttl import PINS, PinPolicy, benefit, decide

__all__ = [
    "ANY",
    "PINS",
    "AgentConfig",
    "Anchor",
    "AnchorConfig",
    "AnchorPool",
    "Costs",
    "EngineCosts",
    "Expirer",
    "PinPolicy",
    "Predictor",
    "Prior",
    "Program",
    "Programs",
    "benefit",
    "context_key",
    "decide",
    "tool_return",
]
