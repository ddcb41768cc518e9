"""When a request passed each of its stages in the engine: a clock read as each ends (time.monotonic(), the clock
Sequence.arrival reads), handed back with its last output. The gateway makes trace spans of them
(gateway/tracing.py); nothing here knows of tracing, and recording costs a clock read per stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stages:
    """`arrived`: the request reached the engine; `admitted`: the scheduler took it in (the wait before is the
    queue's); `loaded`: its exact head was read (prefix blocks, a program's context) and its documents looked up
    in the tiers; `reused`: a blend of its documents or spans (blend, naive, KVCOMM) ended, None when none ran (a
    lower tier's layers are read as the blend runs over them: their wait is the blend's); `first_token`: its
    first token was sampled (the rest of its prompt prefilled); `ended`: its last output. A stage it did not
    reach is None. `tiers`: what its reads hit, (tier, entries, bytes of their KV) for each tier; `generated`: the
    tokens it generated (its decode's pace: (ended - first_token) / (generated - 1))."""

    arrived: float
    admitted: float | None
    loaded: float | None
    reused: float | None
    first_token: float | None
    ended: float
    tiers: tuple[tuple[str, int, int], ...] = ()
    generated: int = 0
