"""The online quality gate: how far reuse moves answers, measured while serving, and what it allows.

A share of the requests served with reuse (`shadow_rate`) is checked: the engine prefills the same prompt in full,
on idle capacity and on a share of its busy time (`shadow_share`), and compares the two first-token distributions
(runtime/shadow.py). Each reuse mode climbs a ladder of recompute ratios: its own (calibrated) ratio, the larger
`ratios`, then full prefill. The checks of the rung being served decide: missing the target after `min_checks` (or
sooner, once even perfect checks to come could not meet it), the mode climbs one rung; meeting it with a margin over
a whole `window`, it steps one down. At full prefill nothing is reused, so there the checks run the other way: the
reuse one rung below is computed on spare capacity and compared with the full prefill that was served, so the gate
learns when reuse has recovered.

A program's prompt climbs a ladder of its shape, per reuse mode: its reading agent (the agent pairs that end at it;
keyed by the pairs themselves, a pipeline's 7 readers made 26 ladders, because which spans have a source varies from
request to request, and each learnt slower), so a pipeline whose reuse does not generalise is withheld alone. A
shape's ladder also holds the answer to `target_answer` (agents read each other's answers: a drift compounds down
the pipeline), and has two rungs, its reuse and none (the prompt after its exact prefix computed): a recompute ratio
rarely pays on short agent prompts, and each rung would take another `min_checks` checks of a shape seen far more
rarely than the server's one blend. A new shape starts withheld and earns its reuse: its first `min_checks` checks
(of the reuse it withholds, computed on spare capacity) must keep answers, since by the time a served reuse shows it
moved them, the next agent has read them. A shape's rung checked fewer than `min_checks` times is checked on every
request it serves, then at `shadow_rate`. With no checks (`shadow_rate` 0) nothing could earn it: shapes start at
their reuse.

A mode with no calibration (no table for this model's fingerprint, no operator's ratio: runtime/wiring.py
`make_caches`) is calibrated online: its ladder never serves a rung its checks have not measured. It starts at full
prefill, and its checks compute the blend at its lowest rung on spare capacity, every request until `min_checks` of
them (then at `shadow_rate`); once they meet the targets (with the margin a rung is left downward with) that rung
opens and is served, its fidelity reported from those checks; a rung they miss passes the probe to the next one up.
An open rung whose checks miss goes back to full prefill, probing the next rung up: never a lower one, which no
check measured. A shape of such a mode starts withheld even with no checks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

FULL = 1.0  # the top rung: every token computed, nothing reused
RECOVER = 0.8  # a rung is left downward only with KL this far under the target
# Where blends' ratio comes from (`Standing.state`): a table, the operator's ratio, the checks that opened it;
# else full prefill: calibrating online, every rung missed (checked on), no checks to calibrate with.
STATES = ("table", "operator", "shadow", "calibrating", "unmet", "off")
CALIBRATED = STATES[:3]


@dataclass(frozen=True)
class QualityConfig:
    shadow_rate: float = 0.0  # share of gated requests checked against full prefill (0: the gate never moves)
    target_kl: float = 0.05  # mean first-token KL(full || reuse) over the window, at most
    target_top1: float = 0.95  # share of checks whose first token's argmax equals full prefill's, at least
    window: int = 16  # the latest checks of a rung that decide
    min_checks: int = 8  # checks of a rung before it may be left upward
    ratios: tuple[float, ...] = (0.3, 0.5)  # rungs above a mode's own ratio, below full prefill
    max_pending: int = 8  # checks waiting for spare capacity; past it the oldest is dropped
    # Share of the engine's busy time checks may take while requests are running (0: only when idle).
    shadow_share: float = 0.05
    shapes: int = 1024  # shapes with a ladder of their own; past it the least recently served goes
    # A shape's checks: the mean share of the answer's leading tokens equal to full prefill's, at least.
    target_answer: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.shadow_rate <= 1.0:
            raise ValueError(f"shadow_rate {self.shadow_rate} outside [0, 1]")
        if not 0.0 <= self.shadow_share < 1.0:
            raise ValueError(f"shadow_share {self.shadow_share} outside [0, 1)")
        if not 1 <= self.min_checks <= self.window:
            raise ValueError(f"min_checks {self.min_checks} must be in 1..window ({self.window})")
        if any(not 0.0 <= r < FULL for r in self.ratios):
            raise ValueError(f"gate ratios {self.ratios} must lie in [0, 1)")
        if self.shapes < 1:
            raise ValueError(f"shapes {self.shapes} must be at least 1")


@dataclass
class Totals:
    checks: int = 0
    kl: float = 0.0  # summed
    agree: int = 0
    answered: int = 0  # checks that compared the answer's leading tokens
    answer: float = 0.0  # their share of leading tokens equal, summed

    def add(self, kl: float, agree: bool, answer: float | None) -> None:
        self.checks, self.kl, self.agree = self.checks + 1, self.kl + kl, self.agree + agree
        self.answered, self.answer = self.answered + (answer is not None), self.answer + (answer or 0.0)


class Ladder:
    """One reuse mode's (or shape's) rungs, where it stands, and the checks of that rung."""

    def __init__(self, base: float, config: QualityConfig, shape: bool = False, online: bool = False) -> None:
        self.rungs = [base, FULL] if shape else [base, *sorted(r for r in set(config.ratios) if r > base), FULL]
        self.target_answer = config.target_answer if shape else 0.0
        top = len(self.rungs) - 1
        # A mode's ladder with no calibration serves only rungs its checks opened (`trial`: the one they probe).
        self.online = online and not shape
        # A shape's reuse is served once its checks show it keeps answers (where checks run at all): it
        # comes back after min_checks of them, not a whole window; so does an online ladder's first rung.
        self.recover_after = config.min_checks if shape or self.online else config.window
        self.at = top if (shape and (config.shadow_rate > 0 or online)) or self.online else 0
        self.floor = self.at if self.online else 0  # the lowest rung the ladder may step down to
        self.trial: int | None = 0 if self.online else None  # an online ladder at full prefill: the rung probed
        self.exhausted = False  # an online ladder whose every rung missed: the largest probed on, at shadow_rate
        self.checks: deque[tuple[float, bool]] = deque(maxlen=config.window)
        self.answers: deque[float] = deque(maxlen=config.window)  # the checks' answer agreement (decides for a shape)
        self.why = ""  # the last climb's reason, while above the first rung
        if self.at and shape:
            self.why = f"a new agent's reuse, served once {config.min_checks} shadow checks meet the targets"
            if config.shadow_rate <= 0:
                self.why = "uncalibrated: no shadow checks (quality.shadow_rate 0) to measure this agent's blend"
        self.totals = Totals()
        self.asked = 0  # checks made due at this rung, less those that came to nothing (`QualityGate.void`)

    @property
    def ratio(self) -> float:
        return self.rungs[self.at]

    @property
    def probe(self) -> float:
        """The ratio a check measures: the served one, or at full prefill the one below it (an online
        ladder's: the one it is calibrating)."""
        if self.trial is not None:
            return self.rungs[self.trial]
        return self.rungs[self.at - 1] if self.ratio == FULL else self.ratio

    @property
    def learning(self) -> bool:
        """Whether each request is checked (up to min_checks of the rung probed): an online ladder calibrating."""
        return self.trial is not None and not self.exhausted

    def ask(self, by: int = 1) -> int:
        """A check made due at this rung (-1: one came to nothing): how many are now."""
        self.asked = max(0, self.asked + by)
        return self.asked

    def try_rung(self, trial: int, why: str) -> None:
        """An online ladder at full prefill, probing rung `trial` (past the largest below full prefill: the
        largest again, exhausted); its checks start over."""
        top = len(self.rungs) - 1
        self.exhausted, self.trial = trial >= top, min(trial, top - 1)
        self.at = self.floor = top
        self.checks.clear()
        self.answers.clear()
        self.asked = 0
        self.why = why

    def open(self) -> None:
        """An online ladder's probed rung met the targets: served from now on, its checks kept (they measured it)."""
        assert self.trial is not None
        self.at = self.floor = self.trial
        self.trial, self.exhausted, self.why, self.asked = None, False, "", 0

    def means(self, pad: int = 0) -> tuple[float, float]:
        """The mean KL and top-1 of the rung's checks, with `pad` perfect checks more."""
        n = len(self.checks) + pad
        return sum(k for k, _ in self.checks) / n, (sum(a for _, a in self.checks) + pad) / n

    def answer(self, pad: int = 0) -> float | None:
        """The mean answer agreement of the rung's checks, with `pad` perfect ones more; None: none compared."""
        return (sum(self.answers) + pad) / (len(self.answers) + pad) if self.answers else None

    def meets(self, config: QualityConfig, margin: float = 1.0, pad: int = 0) -> bool:
        """Whether the rung's checks meet the targets (KL with `margin` under its own); with `pad` perfect
        checks more, whether it still can."""
        (kl, top1), answer = self.means(pad), self.answer(pad)
        answered = answer is None or answer >= self.target_answer  # a mean of 0.0 is a miss, not "none"
        return kl <= margin * config.target_kl and top1 >= config.target_top1 and answered

    def move(self, by: int, why: str = "") -> None:
        self.at, self.asked, self.why = self.at + by, 0, why if self.at + by else ""
        self.checks.clear()
        self.answers.clear()


@dataclass(frozen=True)
class Standing:
    """Where blends' recompute ratio comes from (`STATES`), as /ready and the metrics say it."""

    state: str
    ratio: float | None = None  # the ratio served (None: a table's, per document count; or none: full prefill)
    probe: float | None = None  # calibrating online: the ratio the checks measure
    checks: int = 0  # the checks of that ratio (once open: those that opened it and the latest since)
    needed: int = 0  # checks meeting the targets that open a ratio
    note: str = ""

    @property
    def calibrated(self) -> bool:
        return self.state in CALIBRATED


def shape_key(mode: str, shape: str) -> str:
    """The key of a mode's ladder for one shape ("" : the mode's own)."""
    return f"{mode}/{shape}" if shape else mode


def mode_of(key: str) -> str:
    """The reuse mode of a ladder's key."""
    return key.split("/", 1)[0]


class QualityGate:
    """The ladders of the gated reuse modes, and of agent programs' shapes, by key (`shape_key`). Read from
    any thread, moved by the engine's."""

    def __init__(self, config: QualityConfig, base: dict[str, float], online: Iterable[str] = ()) -> None:
        self.config = config
        self.online = set(online)  # the modes calibrated online: no table, no operator's ratio
        self.ladders = {mode: Ladder(ratio, config, online=mode in self.online) for mode, ratio in base.items()}
        self.shapes: OrderedDict[str, Ladder] = OrderedDict()  # bounded by config.shapes, least recent first
        self.credit = 0.0  # shadow_rate accumulated: a check is due at each whole one
        self.due_count = 0  # checks that came due
        self.dropped = 0  # of those, dropped: too many were waiting
        self.lock = threading.Lock()

    def ladder(self, key: str) -> Ladder:
        """A key's ladder; a shape's is made at its mode's own ratio when new. Under the lock."""
        if key in self.ladders:
            return self.ladders[key]
        ladder = self.shapes.get(key)
        if ladder is None:
            online = mode_of(key) in self.online
            ladder = self.shapes[key] = Ladder(self.base(key), self.config, shape=True, online=online)
            while len(self.shapes) > self.config.shapes:
                self.shapes.popitem(last=False)
        self.shapes.move_to_end(key)
        return ladder

    def base(self, key: str) -> float:
        return self.ladders[mode_of(key)].rungs[0]

    def uncalibrated(self, mode: str) -> None:
        """`mode` has no calibration (no table, no operator's ratio): from now on it is calibrated online,
        never served at a rung its shadow checks have not opened. Before any request."""
        with self.lock:
            self.online.add(mode)
            self.ladders[mode] = Ladder(self.base(mode), self.config, online=True)
            for key in [key for key in self.shapes if mode_of(key) == mode]:
                del self.shapes[key]

    def calibrating(self, key: str) -> float | None:
        """The ratio an online ladder at full prefill is calibrating (its checks compute that blend); else None."""
        with self.lock:
            ladder = self.ladder(key)
            return ladder.probe if ladder.trial is not None else None

    def serve(self, key: str) -> tuple[float, str]:
        """The recompute ratio to serve `key` with (FULL: no reuse), and why when above its own."""
        with self.lock:
            ladder = self.ladder(key)
            ratio, why, raised = ladder.ratio, ladder.why, ladder.at > ladder.floor
            if ladder.trial is not None:  # calibrating online: full prefill until a rung opens
                return FULL, self.note(ladder)
        if not raised:
            return ratio, ""
        which = "quality gate (this agent)" if key != mode_of(key) else "quality gate"
        if ratio == FULL:
            return FULL, f"{which}: {why}; reuse withheld until shadow checks recover"
        return ratio, f"{which}: {why}; recompute raised to {ratio:.0%}"

    def due(self, key: str | None = None) -> bool:
        """Whether the request being served now under `key` gets a check: for a shape, every one while its
        rung has been checked fewer than `min_checks` times; then, and for a mode's own ladder always, every
        1/shadow_rate-th, evenly. (A mode's own ladder checked eagerly would withhold this model's blends
        within ~24 requests at the default targets, which no ratio meets: a product call not taken here.)"""
        if self.config.shadow_rate <= 0.0:
            return False
        learning = False
        if key is not None:
            with self.lock:
                ladder = self.ladder(key) if key != mode_of(key) else self.ladders.get(key)
                if ladder is not None and (key != mode_of(key) or ladder.learning):
                    learning = ladder.ask() <= self.config.min_checks
        if not learning:
            self.credit += self.config.shadow_rate
            if self.credit < 1.0:
                return False
            self.credit -= 1.0
        self.due_count += 1
        return True

    def probe(self, key: str) -> float:
        with self.lock:
            return self.ladder(key).probe

    def void(self, key: str, ratio: float, dropped: bool = False) -> None:
        """A check made due for `key` at `ratio` recorded nothing (`dropped`, or nothing to reuse): while the
        ladder still probes that rung, it is asked again, so a shape earns its reuse from checks that compared."""
        with self.lock:
            self.dropped += dropped
            if (ladder := self.ladder(key)).probe == ratio:
                ladder.ask(-1)

    def record(self, key: str, ratio: float, kl: float, agree: bool, answer: float | None = None) -> None:
        """A check of `key` at `ratio` (the rung it probed when it was taken); `answer`: the share of the
        answer's leading tokens equal (decided on by a shape's ladder only). A check of a rung the ladder
        has since left says nothing about where it stands: it only counts in the totals."""
        c = self.config
        with self.lock:
            ladder = self.ladder(key)
            ladder.totals.add(kl, agree, answer)
            if ratio != ladder.probe:
                return
            ladder.checks.append((kl, agree))
            if answer is not None:
                ladder.answers.append(answer)
            n = len(ladder.checks)
            recovered = n >= ladder.recover_after and ladder.meets(c, RECOVER)
            # Fewer than min_checks checks decide once they miss even if every check still to come is perfect:
            # the decision min_checks would make, made as soon as it is certain.
            missed = not ladder.meets(c, pad=max(0, c.min_checks - n))
            if ladder.trial is not None:  # calibrating online: open the rung probed, or probe the next one up
                if recovered:
                    ladder.open()
                elif missed and not ladder.exhausted:
                    ladder.try_rung(ladder.trial + 1, why_missed(ladder, c, n, ratio))
                return
            if ladder.ratio == FULL:  # the checks are of the rung below: recovered, go back to it
                if recovered:
                    ladder.move(-1, ladder.why)
                return
            if missed and ladder.online:  # back to full prefill: the next rung up has no check of its own yet
                ladder.try_rung(ladder.at + 1, why_missed(ladder, c, n, ratio))
            elif missed:
                ladder.move(+1, why_missed(ladder, c, n, ratio))
            elif ladder.at > ladder.floor and recovered:
                ladder.move(-1, ladder.why)

    def measured(self, key: str, ratio: float) -> tuple[float, float, float | None, int] | None:
        """The mean KL, top-1 and answer agreement (None: not compared) of the latest checks of `key` at
        `ratio`, and how many; None if none."""
        with self.lock:
            ladder = self.ladders.get(key) or self.shapes.get(key)
            if ladder is None or ladder.probe != ratio or not ladder.checks:
                return None
            return (*ladder.means(), ladder.answer(), len(ladder.checks))

    def note(self, ladder: Ladder) -> str:
        """Why an online ladder serves full prefill, and how far its calibration is. Under the lock."""
        c, n, probe = self.config, len(ladder.checks), f"{ladder.probe:.0%}"
        if c.shadow_rate <= 0.0:
            return "uncalibrated: no shadow checks to calibrate online (quality.shadow_rate 0): see kvgate calibrate"
        if ladder.exhausted:
            return (
                f"uncalibrated: no recompute ratio up to {probe} met the fidelity target in shadow checks "
                f"({ladder.why}); checked on"
            )
        done = f"{n}/{c.min_checks}" if n < c.min_checks else f"{n} (not yet within the targets' margin)"
        missed = f"; {ladder.why}" if ladder.why else ""
        return f"uncalibrated: calibrating online ({done} shadow checks of a {probe} blend{missed})"

    def standing(self, mode: str) -> Standing | None:
        """Where an online mode stands (None: `mode` is not calibrated online)."""
        with self.lock:
            ladder = self.ladders.get(mode)
            if ladder is None or not ladder.online:
                return None
            n, needed = len(ladder.checks), self.config.min_checks
            if ladder.trial is None:
                return Standing("shadow", ratio=ladder.ratio, checks=n, needed=needed)
            state = "off" if self.config.shadow_rate <= 0.0 else "unmet" if ladder.exhausted else "calibrating"
            return Standing(state, probe=ladder.probe, checks=n, needed=needed, note=self.note(ladder))

    def stats(self) -> Iterable[tuple[str, dict[str, float]]]:
        """Per mode, over its ladders (its own and its shapes'): lifetime checks, their mean KL, top-1 and
        answer agreement, the windows' KL and top-1, the highest ratio served, how many ladders and how
        many of them withhold reuse."""
        with self.lock:
            for mode, own in self.ladders.items():
                ladders = [own, *(ladder for key, ladder in self.shapes.items() if mode_of(key) == mode)]
                checks = sum(ladder.totals.checks for ladder in ladders)
                answered = sum(ladder.totals.answered for ladder in ladders)
                window = [check for ladder in ladders for check in ladder.checks]
                nan = float("nan")
                yield (
                    mode,
                    {
                        "checks": checks,
                        "kl": sum(ladder.totals.kl for ladder in ladders) / checks if checks else nan,
                        "top1": sum(ladder.totals.agree for ladder in ladders) / checks if checks else nan,
                        "answer": sum(ladder.totals.answer for ladder in ladders) / answered if answered else nan,
                        "window_kl": sum(k for k, _ in window) / len(window) if window else nan,
                        "window_top1": sum(a for _, a in window) / len(window) if window else nan,
                        "ratio": max(ladder.ratio for ladder in ladders),
                        "ladders": len(ladders),
                        "withheld": sum(ladder.ratio == FULL for ladder in ladders),
                    },
                )


def why_missed(ladder: Ladder, c: QualityConfig, n: int, ratio: float) -> str:
    kl, top1 = ladder.means()
    answer, targets = ladder.answer(), f"target KL <= {c.target_kl:g}, top-1 >= {c.target_top1:.0%}"
    answered = ""
    if ladder.target_answer and answer is not None:
        answered, targets = f", answers {answer:.2f}", f"{targets}, answers >= {ladder.target_answer:.2f}"
    return (
        f"first-token KL {kl:.3f}, top-1 {top1:.0%}{answered} over the last {n} shadow checks at "
        f"{ratio:.0%} recompute ({targets})"
    )
