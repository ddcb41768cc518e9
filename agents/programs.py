"""Agent programs (Continuum): which turns belong together, the KV each keeps for the next, and
how long that KV stays pinned while the program waits for its tools.

A turn starts with `begin`: a request that returns tool results tells how long those tools took
(its arrival minus the previous turn's end); the turn gets the key of the program's stored context
to continue from, a key to keep its own under, and the TTL to pin it for. `end` records the turn's
end; `expire` demotes pins whose time is up to a lower tier.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.agents.config import AgentConfig
from kvgate.agents.costs import Costs
from kvgate.agents.flight import Flight
from kvgate.agents.predictor import Predictor, Seen, SharedTools
from kvgate.agents.ttl import cdf, decide
from kvgate.chunk_cache import ChunkStore

# Of each new sample in the running means below: the queue turns find, what memory keeps earns.
RECENT = 1 / 16
# A program whose tools have not returned by the time this share of such returns have is counted
# out of the programs in flight (its client may have ended it without another request).
LATE = 0.95
SHARE_S = 1.0  # how often tool durations are pooled with the other replicas'
log = logging.getLogger("kvgate.agents")


def running(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + RECENT * (sample - mean)


@dataclass(frozen=True)
class Turn:
    """A turn of an agent program: where program FCFS queues it, the stored context it continues,
    and the key to keep its own context under when it ends, pinned for `pin_s` seconds."""

    program: str
    arrival: float  # the program's first arrival (time.monotonic)
    tenant: str = ""
    first: bool = False  # the program's first turn: it may wait for room among the programs in flight
    pinned: bool = False  # the context it continues is pinned in memory: program FCFS admits it first
    resume: str = ""
    keep: str = ""
    pin_s: float = 0.0


@dataclass
class Program:
    id: str
    tenant: str
    arrival: float  # the first turn's arrival: program FCFS orders every later turn by it
    seen: float
    turns: int = 0
    context: str = ""  # chunk key of the latest stored context
    ended: float | None = None  # when the latest turn ended
    tools: tuple[str, ...] = ()  # the tools of its latest tool call (): none yet
    pinned_until: float = -math.inf
    late_s: float = math.inf  # its tools' results are late this long after its latest turn ended

    def began(self, now: float, tools: tuple[str, ...]) -> None:
        """A turn came, after a call of `tools` (its latest call's, where it did not come back from one)."""
        self.tools, self.seen, self.turns = tools, now, self.turns + 1

    def late_after(self, seconds: float) -> None:
        self.late_s = seconds

    def pin(self, until: float) -> None:
        """Its context pinned until then (-inf: not pinned)."""
        self.pinned_until = until

    def end(self, now: float) -> None:
        """Its turn ended: a pin held for the turn ends with it."""
        self.ended, self.seen, self.pinned_until = now, now, -math.inf

    def keep(self, context: str) -> str:
        """Its latest stored context is now `context`: the one before, to delete ("" when the same)."""
        stale, self.context = (self.context, context) if self.context != context else ("", self.context)
        return stale


def tool_return(messages: list[dict[str, Any]]) -> tuple[str, ...] | None:
    """The tools whose results end these messages (OpenAI format: an assistant turn with
    `tool_calls`, then `tool` messages); () when the names are not given; None: not a tool return."""
    end = len(messages)
    while end and messages[end - 1].get("role") in ("tool", "function"):
        end -= 1
    results = messages[end:]
    if not results:
        return None
    names = [m["name"] for m in results if isinstance(m.get("name"), str)]
    if end and messages[end - 1].get("role") == "assistant":
        for call in messages[end - 1].get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.append(function["name"])
    return tuple(sorted(set(names)))


def context_key(tenant: str, program: str, turn: int) -> str:
    h = hashlib.sha256()
    for part in ("kvgate.program.v1", tenant, program, str(turn)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


class Programs:
    """The registry of live programs and their pins; thread-safe."""

    def __init__(
        self,
        config: AgentConfig,
        store: ChunkStore,
        costs: Costs,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedTools | None = None,
        flight: Flight | None = None,
    ) -> None:
        self.config, self.store, self.costs, self.clock, self.shared = config, store, costs, clock, shared
        # Tool durations per tenant: one tenant's tools never move another's pins.
        self.predictors: OrderedDict[str, Predictor] = OrderedDict()
        self.seen: dict[str, Seen] = {}  # per tenant with a turn since the last pooling: what it saw here
        self.shared_at, self.failing = -math.inf, False
        self.programs: OrderedDict[tuple[str, str], Program] = OrderedDict()  # least recently seen first
        self.evicted: list[str] = []  # pinned contexts of programs forgotten for room: demoted by expire
        self.deadlines: list[tuple[float, str, str]] = []  # (pinned until, tenant, program id)
        self.ended = self.returned = 0  # turns ended; turns that came back with tool results
        # The queue program turns find when they arrive: what a pinned turn's return passes, a tool's
        # time after the decision (priced at the queue of the moment, which at moderate load has
        # drained by then, the sweep's pins lost 2% more at load 0.95). And of the contexts kept:
        # P(back within the residence) x saved, and the share of memory each holds (memory's rate).
        self.queue_found: float | None = None
        self.kept_earns: float | None = None
        self.kept_holds: float | None = None
        # The programs in flight: the engine's (whose scheduler holds first turns at its door), else of its own.
        if flight is None:
            flight = Flight(costs.memory_bytes, config.in_flight, config.in_flight_linger_s, clock)
        self.flight = flight
        self.lock = threading.Lock()
        self.wake = threading.Event()  # a new deadline: the expiry thread looks again

    def begin(self, program_id: str | None, tenant: str, messages: list[dict[str, Any]], prompt_tokens: int) -> Turn:
        now = self.clock()
        if program_id is None:  # its own program: nothing comes after it
            return Turn(uuid.uuid4().hex, now)
        tools = tool_return(messages)
        queue = self.costs.queue_s()
        with self.lock:
            self.queue_found = running(self.queue_found, queue)
            p = self.programs.get((tenant, program_id))
            if p is None:
                p = self.programs[(tenant, program_id)] = Program(program_id, tenant, now, now)
                self.make_room(now)
            predictor = self.predictor(tenant)
            seen = self.seen.setdefault(tenant, Seen()) if self.shared is not None else None
            if tools is not None and p.ended is not None:
                predictor.observe(tools, now - p.ended)
                predictor.called(p.tools, tools)
                if seen is not None:
                    seen.add(p.tools, tools, now - p.ended)
                self.returned += 1
            else:
                tools = p.tools  # not back from a call: its latest call's stay
            p.began(now, tools)
            self.programs.move_to_end((tenant, program_id))
            self.flight.back(tenant, p.id)
            # Program FCFS admits a pinned program's turn first; so too one that holds the context memory
            # kept unpinned until admitted (under overload program order is most of what pins win: a
            # held turn behind new programs loses it; under less, turns that memory serves anyway should
            # not pass others: the sweep lost 4% at load 0.95 when every returning turn went first).
            resident = self.store.resident(p.context)
            pinned = resident and (p.pinned_until > now or self.hold(p, now))
            waits, p_back = predictor.after(p.tools)
            # Back within this, or gone: the wait by which most returns after such calls have come.
            p.late_after(next((w for w, q in zip(waits, p_back) if q >= LATE), math.inf))
            ttl = self.ttl(waits, p_back, prompt_tokens)
            keep = context_key(tenant, p.id, p.turns)
            return Turn(p.id, p.arrival, tenant, p.turns == 1, pinned, p.context, keep, ttl)

    def resident_s(self) -> float:
        """How long memory keeps an unpinned context: the idle age at which the first tier evicts,
        as measured lately; inf when it evicted nothing for longer than the longest pin (a pin
        decided on an older measure would have ended by now)."""
        return self.store.residence_s(self.config.pins.max_ttl_s)

    def hold(self, p: Program, now: float) -> bool:
        """A turn came back to its unpinned context, still in memory: under memory pressure (decide),
        when memory would evict it before the turn is admitted (the queue the turn would pass is
        longer than the residence it has left), pin it until the turn takes it, as its chance of
        coming back is now 1. One that memory keeps through the wait needs neither pin nor turn."""
        pins = self.config.pins
        residence = self.resident_s()
        if pins.mode != "decide" or residence >= pins.max_ttl_s:
            return False
        idle = now - p.ended if p.ended is not None else 0.0
        if self.costs.queue_s() < residence - idle:
            return False
        p.pin(now + pins.max_ttl_s)  # a turn that never starts lets go at this deadline
        heapq.heappush(self.deadlines, (p.pinned_until, p.tenant, p.id))
        self.wake.set()
        return self.store.pin(p.context, p.pinned_until)

    def predictor(self, tenant: str) -> Predictor:
        """The tenant's tool durations (the newest `max_tenants` tenants' are kept)."""
        found = self.predictors.get(tenant)
        if found is None:
            found = self.predictors[tenant] = Predictor(self.config.prior, max_tools=self.config.max_tools)
            if len(self.predictors) > self.config.max_tenants:
                self.predictors.popitem(last=False)
        self.predictors.move_to_end(tenant)
        return found

    def make_room(self, now: float) -> None:
        """Forget the least recently seen programs past `max_programs`; their pins go with them."""
        while len(self.programs) > self.config.max_programs:
            key, p = self.programs.popitem(last=False)
            self.flight.land(*key)
            if p.pinned_until > now:
                self.evicted.append(p.context)
                self.wake.set()

    def ttl(self, waits: list[float], p_back: list[float], tokens: int) -> float:
        """The pin for the context this turn leaves (`tokens` long): which tool the turn will call
        is not known until the next request shows it, so the wait (`waits`, P(back within) each) is
        predicted from the calls seen to follow the program's last one."""
        c = self.costs
        nbytes = tokens * c.bytes_per_token
        self.flight.measure(nbytes, RECENT)
        reload = c.reload_s(nbytes)
        prefill = c.prefill_s(tokens)
        saved = prefill if reload is None else min(prefill, reload)
        p_next = (self.returned + 1) / (self.ended + 2)  # that a tool call, not the end, comes next
        held = nbytes / max(c.memory_bytes, 1)
        p_back = [p_next * p for p in p_back]
        resident = self.resident_s()
        rate = None
        if 0 < resident < math.inf:
            self.kept_earns = running(self.kept_earns, cdf(waits, p_back, resident) * saved)
            self.kept_holds = running(self.kept_holds, held)
            rate = self.kept_earns / (resident * max(self.kept_holds, 1e-12))
        passed = self.queue_found or 0.0
        return decide(self.config.pins, waits, p_back, saved, held, resident, passed, rate)

    def end(self, tenant: str, turn: Turn, more: bool = True) -> None:
        """The turn's response is complete: its context (if the engine kept it) replaces the
        program's previous one, and stays pinned for the turn's TTL. `more`: the turn called tools
        (or failed), so the program may go on; else it has ended."""
        self.share()
        now = self.clock()
        if not more:
            self.flight.land(tenant, turn.program)
        kept = bool(turn.keep) and turn.keep in self.store
        stale = ""
        with self.lock:
            self.ended += 1
            p = self.programs.get((tenant, turn.program))
            if p is not None and more:
                self.flight.wait(tenant, p.id, p.late_s)
            if p is None or not turn.keep:
                return
            p.end(now)
            self.programs.move_to_end((tenant, turn.program))
            if not kept:
                return
            stale = p.keep(turn.keep)
            p.pin(now + turn.pin_s if turn.pin_s > 0 else -math.inf)
            if turn.pin_s > 0:
                heapq.heappush(self.deadlines, (p.pinned_until, p.tenant, p.id))
                self.wake.set()
        if stale:
            self.store.delete(stale)

    def share(self) -> None:
        """Pool the tool durations seen here with every replica's, for the tenants with turns lately."""
        if self.shared is None or self.clock() - self.shared_at < SHARE_S:
            return
        with self.lock:
            self.shared_at = self.clock()
            seen, self.seen = self.seen, {}
        if not seen:
            return
        try:
            pooled = self.shared.exchange(seen)
        except Exception as exc:  # what was seen here still counts here; the next pooling adds it
            with self.lock:
                for tenant, mine in list(seen.items())[-self.config.max_tenants :]:
                    self.seen.setdefault(tenant, Seen()).follow(mine)
            if not self.failing:
                self.failing = True
                log.warning("tool durations are not pooled: the shared store did not answer (%s)", type(exc).__name__)
            return
        self.failing = False
        with self.lock:
            for tenant, (durations, follows) in pooled.items():
                if tenant in self.predictors:
                    self.predictors[tenant].load(durations, follows)

    def expire(self) -> float | None:
        """Demote the pins whose time is up, forget idle programs; the next deadline, if any."""
        now = self.clock()
        with self.lock:
            due, self.evicted = self.evicted, []
            while self.deadlines and self.deadlines[0][0] <= now:
                _, tenant, pid = heapq.heappop(self.deadlines)
                p = self.programs.get((tenant, pid))
                if p is not None and p.pinned_until <= now and p.pinned_until > -math.inf:
                    p.pin(-math.inf)
                    due.append(p.context)
            for key, p in list(self.programs.items()):
                if now - p.seen > self.config.idle_s:
                    del self.programs[key]
                    self.flight.land(*key)
            following = self.deadlines[0][0] if self.deadlines else None
        for key in due:
            self.store.demote(key)
        return following

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        with self.lock:
            return {
                "programs": len(self.programs),
                "pinned": sum(p.pinned_until > now for p in self.programs.values()),
                "turns_ended": self.ended,
                "tool_returns": self.returned,
                "tenants_predicted": len(self.predictors),
                "in_flight": len(self.flight),
                "in_flight_limit": self.flight.limit(),
            }


class Expirer:
    """A thread that calls `programs.expire()` at each pin's deadline."""

    def __init__(self, programs: Programs, idle_poll_s: float = 5.0) -> None:
        self.programs, self.idle_poll_s = programs, idle_poll_s
        self.stopped = False
        self.thread = threading.Thread(target=self.run, name="kvgate-pin-expiry", daemon=True)
        self.thread.start()

    def run(self) -> None:
        wake = self.programs.wake
        while not self.stopped:
            wake.clear()
            following = self.programs.expire()
            wait = self.idle_poll_s if following is None else max(0.0, following - self.programs.clock())
            wake.wait(min(wait, self.idle_poll_s))

    def close(self) -> None:
        self.stopped = True
        self.programs.wake.set()
        self.thread.join(timeout=5)
