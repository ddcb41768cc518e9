"""Shadow checks: a served request's first token, computed the other way on spare capacity.

The engine hands over a request it served as the quality gate said (runtime/quality.py) together
with the first-token logits it served. The check computes the other side in parts (a full prefill
in chunks, a blend layer by layer), so a request arriving meanwhile waits one part at most; then it
compares the two distributions and tells the gate. Parts run whenever the engine is idle, and
while it is busy on a budget: `shadow_share` of the time its steps take, earned step by step, so
a server that always has work still checks (at that share of its throughput). On a busy engine a
full prefill's rows ride in the engine's own step (`ride`), paid at what they add to it: the step
reads the weights once for both (64 rows on 2 CPU cores: 138 ms added to a decode step, 225 ms alone).

A check's full prefill starts from the previous one's KV where their prompts begin alike: that KV
is full prefill's own, so a run of requests over one context costs one prefill of it in checks.

Besides the first token, a check measures the answer as a user meets it: the served answer's first
`ANSWER` tokens are fed after the other side's prompt (teacher-forced), and the check counts how many
leading positions the other side's greedy choice equals the served side's. For a greedy request that
is how many tokens of the two answers are equal before they first differ.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass

import torch

from kvgate.runtime.kv import KVCache
from kvgate.runtime.model import Run, forward
from kvgate.runtime.quality import FULL, QualityGate, mode_of
from kvgate.runtime.request import Plan
from kvgate.runtime.reuse import ReuseMode, Reuser
from kvgate.runtime.sequence import Sequence
from kvgate.runtime.spans import Spans

log = logging.getLogger("kvgate.engine")

ROWS = 64  # tokens of a full prefill between two looks at the inbox: a request arriving waits little
ANSWER = 32  # the answer's leading tokens a check compares (agents' answers run 24-48 tokens in bench shapes)
MAX_BUDGET_S = 1.0  # the most busy-time budget kept unspent: a long busy stretch buys no burst of checks after it


@dataclass
class Job:
    seq: int  # the served sequence's id
    prompt_ids: list[int]
    plan: Plan
    mode: str  # the gate's key: a mode's, or an agent program's shape's (runtime/quality.py: shape_key)
    ratio: float  # the rung served (FULL: full prefill was)
    logits: torch.Tensor  # the first token's, as served
    answer: list[int]  # the served answer's tokens, as they are sampled (the sequence's own list)
    greedy: list[int]  # the served side's greedy choice at each of the answer's first ANSWER positions
    over: bool = False  # the sequence left the engine: its answer is as long as it gets

    def end(self) -> None:
        self.over = True


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, bool]:
    """First-token KL(reference || other) and whether their argmax agree."""
    p, q = reference.float().log_softmax(-1), other.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum()), bool(reference.argmax() == other.argmax())


def common(a: list[int], b: list[int]) -> int:
    """How many tokens a and b begin with alike."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Shadow:
    def __init__(self, gate: QualityGate, reuser: Reuser, spans: Spans) -> None:
        self.gate, self.reuser, self.spans = gate, reuser, spans
        self.jobs: deque[Job] = deque()
        self.running: Generator[float | Run, torch.Tensor | None, None] | None = None
        self.wanted: Run | None = None  # the running check's next rows to compute, in a step or alone
        self.rode_s = 0.0  # what the rows ridden in the latest step added to it
        self.rides = 0  # parts computed in the engine's steps (the benchmark counts them)
        self.spent_s = 0.0  # busy time paid for checks, ridden or alone
        self.budget_s = 0.0  # busy time checks may still take, in seconds
        self.last: tuple[list[int], KVCache] | None = None  # the latest full prefill's prompt and KV
        self.followed: dict[int, Job] = {}  # sequence id -> its job, while its check waits

    def served(self, seq: Sequence, logits: torch.Tensor) -> None:
        """A token of `seq` is sampled from `logits`: its first offers a check (when one is due and
        there is room, else it is dropped); while a check waits, the next ones' greedy choices are kept."""
        followed = self.followed.get(seq.id)
        if followed is not None:
            if len(followed.greedy) < ANSWER:
                followed.greedy.append(int(logits.argmax()))
            return
        prompt = seq.prompt
        if prompt.gated is None or prompt.plan is None or seq.output_ids or not self.gate.due(prompt.gated[0]):
            return
        if len(self.jobs) >= self.gate.config.max_pending:
            self.drop(self.jobs.popleft())  # the oldest: the newest says more of where the gate stands now
        first = logits.detach().float().clone()
        job = Job(
            seq.id, list(seq.prompt_ids), prompt.plan, *prompt.gated, first, seq.output_ids, [int(first.argmax())]
        )
        self.jobs.append(job)
        self.followed[seq.id] = job

    def drop(self, job: Job) -> None:
        """A check made due that will not run; the gate asks again while the rung it would probe stands."""
        self.followed.pop(job.seq, None)
        self.gate.void(job.mode, self.gate.probe(job.mode) if job.ratio == FULL else job.ratio, dropped=True)

    def stale(self, job: Job) -> bool:
        """Whether the check would probe a rung its ladder has left since it was served (the gate would
        only count it in the totals: its cost is better spent on one that decides)."""
        return job.ratio != FULL and job.ratio != self.gate.probe(job.mode)

    def next_job(self) -> Job | None:
        """The check to run next, newest first (under a backlog the latest served say most of where the
        gate stands): the newest whose answer is written, else the newest. Stale ones are dropped unrun."""
        for job in [job for job in self.jobs if self.stale(job)]:
            self.jobs.remove(job)
            self.drop(job)
        ready = [job for job in self.jobs if job.over or len(job.greedy) >= ANSWER]
        job = ready[-1] if ready else self.jobs[-1] if self.jobs else None
        if job is not None:
            self.jobs.remove(job)
        return job

    def ended(self, seq_id: int) -> None:
        """A sequence left the engine (finished or aborted): its check compares the answer it has."""
        if (job := self.followed.get(seq_id)) is not None:
            job.end()

    @property
    def busy(self) -> bool:
        return self.running is not None or bool(self.jobs)

    def earn(self, seconds: float) -> None:
        """The engine was busy for `seconds`: checks may take their share of it."""
        self.budget_s = min(MAX_BUDGET_S, self.budget_s + self.gate.config.shadow_share * seconds)

    def busy_for(self, seconds: float) -> None:
        """The engine ran a step of `seconds`: earn the checks' share of it (not of the rows they rode
        in it), and run a part alone if it is not spent and is not rows that can ride in the next."""
        self.earn(seconds - self.rode_s)
        self.rode_s = 0.0
        if self.affordable and self.wanted is None:
            self.step(charged=True)

    @property
    def affordable(self) -> bool:
        """A part may run while the engine is busy: one is waiting and the budget is not spent."""
        return self.busy and self.budget_s > 0.0

    def ride(self) -> Run | None:
        """Rows of the running check for the engine's step to compute with its own, if the budget affords them."""
        return self.wanted if self.budget_s > 0.0 else None

    def rode(self, logits: torch.Tensor, seconds: float) -> None:
        """The engine computed the rows `ride` gave, their last row's logits `logits`, adding `seconds` to its step."""
        self.budget_s -= seconds
        self.spent_s += seconds
        self.rode_s, self.rides = seconds, self.rides + 1
        self.advance(logits)

    def step(self, charged: bool = False) -> None:
        """Run one part of the current check alone; `charged`: on busy time, paid from the budget."""
        start = time.perf_counter()
        if self.running is None:
            job = self.next_job()
            if job is None:
                return
            self.running = self.check(job)
        try:
            computed = None if self.wanted is None else forward(self.reuser.model, [self.wanted])[0]
        except Exception:
            self.abandon()
        else:
            self.advance(computed)
        if charged:
            took = time.perf_counter() - start
            self.budget_s -= took
            self.spent_s += took

    def advance(self, computed: torch.Tensor | None) -> None:
        """Run the check on to its next part, given the logits of the rows it wanted computed."""
        assert self.running is not None
        self.wanted = None
        try:
            part = self.running.send(computed)
        except StopIteration:
            self.running = None
        except Exception:
            self.abandon()
        else:
            self.wanted = part if isinstance(part, Run) else None

    def abandon(self) -> None:
        """A check that fails says nothing about reuse; serving goes on."""
        log.exception("a shadow check failed")
        self.running, self.wanted, self.last = None, None, None

    def check(self, job: Job) -> Generator[float | Run, torch.Tensor | None, None]:
        probe = self.gate.probe(job.mode)
        try:
            if job.ratio == FULL:  # full prefill was served: compute the reuse it withheld
                probed = yield from self.reuse(job, probe)
                if probed is None:  # nothing to reuse in this prompt (no span with a close anchor): says nothing
                    self.gate.void(job.mode, probe)
                    return
                kv, computed = probed
                reference, other = job.logits, computed
            else:
                kv, computed = yield from self.full(job.prompt_ids)
                reference, other, probe = computed, job.logits, job.ratio
            kl, agree = compare(reference, other)
            while len(job.greedy) < ANSWER and not job.over:  # compared once written (an early check saw 2 tokens)
                yield 0.0
            same = yield from self.answer(kv, int(computed.argmax()), job)
        finally:
            self.followed.pop(job.seq, None)
        self.gate.record(job.mode, probe, kl, agree, same)

    def answer(self, kv: KVCache, first: int, job: Job) -> Generator[float | Run, torch.Tensor | None, float]:
        """The share of the served answer's leading tokens (up to ANSWER) whose greedy choice the other
        side, its prompt's KV in `kv` and its first choice `first`, makes too: the served tokens fed."""
        n = min(len(job.greedy), len(job.answer), ANSWER)
        choices = [first]
        if n > 1:
            logits = forward(self.reuser.model, [Run(kv, job.answer[: n - 1], len(kv))], every=True)
            choices += logits.argmax(-1).tolist()
            yield float(n - 1)
        return common(choices, job.greedy[:n]) / max(n, 1)

    def full(self, ids: list[int]) -> Generator[float | Run, torch.Tensor | None, tuple[KVCache, torch.Tensor]]:
        """Full prefill's KV and first-token logits, from the previous check's KV where the prompts agree:
        it yields the rows to compute, in parts, and is sent their last row's logits."""
        kv, same = self.reuser.new_kv(), 0
        if self.last is not None:
            same = min(common(self.last[0], ids), len(ids) - 1)  # the last token is computed: its logits
            if same:
                kv = self.last[1]
                kv.truncate(same)
        self.last = None  # while it grows, the KV is this check's
        logits = None
        for start in range(same, len(ids), ROWS):
            logits = yield Run(kv, ids[start : start + ROWS], start)
        assert logits is not None
        self.last = (list(ids), kv)  # rows after the prompt (an answer fed) are cut by the next check
        return kv, logits

    def reuse(
        self, job: Job, ratio: float
    ) -> Generator[float | Run, torch.Tensor | None, tuple[KVCache, torch.Tensor] | None]:
        """The withheld reuse's KV and first-token logits; None where it would reuse nothing."""
        plan, kv = job.plan, self.reuser.new_kv()
        asked = ReuseMode("blend", None if ratio == self.gate.base(job.mode) else ratio)
        if mode_of(job.mode) == "kvcomm":
            done = self.spans.prefill(kv, plan.pieces, plan.spans, "kvcomm", plan.agent, plan.scope, ratio).prefilled
            if done.mode == "full":
                return None
        else:
            done = yield from self.reuser.prefilling(kv, plan.pieces, plan.documents, asked, plan.scope)
        if done.logits is not None:
            return kv, done.logits
        rest = job.prompt_ids[len(kv) :]
        return kv, forward(self.reuser.model, [Run(kv, rest, len(kv))])[0]
