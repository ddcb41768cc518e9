"""`kvgate bench semantic`: how well the semantic cache tells a paraphrase from a different question,
on QQP question pairs (store one side, ask with the other): one global threshold against
per-category thresholds, with and without the guards; paraphrases against typed and natural traps;
and lookup latency through the real SemanticCache at growing sizes."""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvgate.bench.data import DataError, Half, Pair, load_pairs
from kvgate.bench.plots import figure, image
from kvgate.bench.semantic_bound import bound_section
from kvgate.bench.semantic_hit import bench_hit
from kvgate.bench.semantic_latency import SEED, latency_pool, latency_section
from kvgate.bench.traps import Served, section, serve, traps_for
from kvgate.bench.verifier_fit import fit_verifier as fit_on
from kvgate.gateway.settings import Settings
from kvgate.runtime.progress import progress
from kvgate.runtime.report import pct, table, write_section
from kvgate.semantic_cache import MiniLM, SemanticCacheConfig
from kvgate.semantic_cache.embedder import Embedder
from kvgate.semantic_cache.policy import Classifier
from kvgate.semantic_cache.verifier import SHIPPED, Verifier

if TYPE_CHECKING:
    from matplotlib.axes import Axes

REFERENCES = {"GPTCache-like, 0.7": 0.7, "RedisVL-like, 0.9 (distance 0.1)": 0.9}
RECALLS = (0.5, 0.6, 0.7, 0.8, 0.9)
LAMBDAS = np.geomspace(0.01, 100.0, 161)
NEVER = 1.01  # a threshold no cosine similarity reaches


def embed_cached(embedder: Embedder, texts: list[str], cache_dir: Path) -> np.ndarray:
    """Embeddings of `texts`, kept in an .npy file keyed by the model and a hash of the texts."""
    h = xxhash.xxh3_64(embedder.name.encode())
    for text in texts:
        h.update(text.encode() + b"\0")
    path = cache_dir / "bench" / f"semantic-{len(texts)}-{h.hexdigest()}.npy"
    if path.is_file():
        return np.load(path)
    start, parts = time.perf_counter(), []
    for i in progress(range(0, len(texts), 2048), "embedding batches of 2048"):
        parts.append(embedder.embed(texts[i : i + 2048]))
        done = i + len(parts[-1])
        print(f"embedded {done}/{len(texts)} ({done / (time.perf_counter() - start):.0f}/s)", flush=True)
    vectors = np.concatenate(parts) if parts else np.zeros((0, embedder.dim), np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.npy")
    np.save(tmp, vectors)
    tmp.replace(path)
    return vectors


def make_half(pairs: list[Pair], a: np.ndarray, b: np.ndarray, rows: np.ndarray, classify: Classifier) -> Half:
    names = [c.name for c in classify.config.categories]
    row_of: dict[str, int] = {}
    for r in rows:
        row_of.setdefault(pairs[r][0], int(r))
    stored = list(row_of)
    slot = {text: i for i, text in enumerate(stored)}
    asked = [int(r) for r in rows if pairs[r][1] not in slot]
    queries = [pairs[r][1] for r in asked]
    return Half(
        stored=stored,
        svecs=a[[row_of[t] for t in stored]],
        queries=queries,
        qvecs=b[asked],
        own=np.array([slot[pairs[r][0]] for r in asked]),
        dup=np.array([pairs[r][2] for r in asked], dtype=bool),
        cat=np.array([names.index(classify(q, b[r]).name) for q, r in zip(queries, asked, strict=True)]),
        left_out=len(rows) - len(asked),
    )


def correct(h: Half, s: Served) -> np.ndarray:
    return (s.entry == h.own) & h.dup


def rates(h: Half, s: Served, limit: np.ndarray) -> tuple[float, float, int]:
    """Precision, recall and hits with a threshold per query."""
    hit = s.score >= limit
    tp = int((hit & correct(h, s)).sum())
    return tp / max(int(hit.sum()), 1), tp / max(int(h.dup.sum()), 1), int(hit.sum())


def curve(h: Half, s: Served) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The single-threshold curve: thresholds (descending), precision and recall at each."""
    order = np.argsort(-s.score, kind="stable")
    order = order[s.entry[order] >= 0]  # the guards refused every candidate: never served
    tp = np.cumsum(correct(h, s)[order])
    return s.score[order], tp / np.arange(1, len(order) + 1), tp / max(int(h.dup.sum()), 1)


def best_f1(h: Half, s: Served) -> float:
    thr, p, r = curve(h, s)
    return float(thr[int(np.argmax(2 * p * r / np.maximum(p + r, 1e-9)))])


def sweep(h: Half, s: Served, ncat: int) -> list[np.ndarray]:
    """Per-category thresholds for each cost λ: in each category the threshold maximising TP − λ·FP,
    which traces the best merged precision-recall curve on this half."""
    ok = correct(h, s)
    sorted_ = []
    for c in range(ncat):
        m = h.cat == c
        order = np.argsort(-s.score[m], kind="stable")
        sc, o = s.score[m][order], ok[m][order]
        ends = np.nonzero(np.append(sc[:-1] > sc[1:], True))[0] if len(sc) else np.zeros(0, int)
        sorted_.append((sc, np.cumsum(o), ends))
    found = []
    for lam in LAMBDAS:
        thresholds = np.full(ncat, NEVER)
        for c, (sc, tp, ends) in enumerate(sorted_):
            if len(ends):
                gain = tp[ends] - lam * (ends + 1 - tp[ends])
                k = int(np.argmax(gain))
                if gain[k] > 0:
                    thresholds[c] = sc[ends[k]]
        found.append(thresholds)
    return found


def pick(h: Half, s: Served, points: list[np.ndarray], target: float) -> int:
    """The sweep's point of highest precision on this half among those reaching `target` recall."""
    scored = [(*rates(h, s, t[h.cat])[:2], i) for i, t in enumerate(points)]
    reaching = [x for x in scored if x[1] >= target]
    return (max(reaching) if reaching else max(scored, key=lambda x: (x[1], x[0])))[2]


def delta_ci(h: Half, s: Served, one: np.ndarray, other: np.ndarray, n: int = 500) -> tuple[float, float]:
    """95% bootstrap interval (queries resampled) of precision(one) − precision(other)."""
    rng = np.random.default_rng(SEED)
    ok = correct(h, s)
    hit1, hit2 = s.score >= one, s.score >= other
    deltas = []
    for _ in range(n):
        i = rng.integers(0, len(ok), len(ok))
        p1 = (hit1[i] & ok[i]).sum() / max(hit1[i].sum(), 1)
        p2 = (hit2[i] & ok[i]).sum() / max(hit2[i].sum(), 1)
        deltas.append(p1 - p2)
    lo, hi = np.percentile(deltas, [2.5, 97.5])
    return float(lo), float(hi)


def gateway_section(settings: Settings, pairs: list[Pair], test: Half, asked: int) -> str:
    """A semantic hit through the gateway against the model's answer, on the test half's first duplicates."""
    if not asked:
        return ""
    chosen = [(q, test.stored[test.own[i]]) for i, q in enumerate(test.queries) if test.dup[i]][:asked]
    with tempfile.TemporaryDirectory() as tmp:
        body = bench_hit(settings, [(stored, query) for query, stored in chosen], 64, Path(tmp))
    return "\n\n### A hit through the gateway\n\n" + body


# ---- the run ----------------------------------------------------------------------------------


def plot(path: Path, curves: dict[str, tuple[np.ndarray, np.ndarray]], points: dict[str, tuple[float, float]]) -> None:
    with figure(path, 1, (7.5, 5.5)) as (ax,):
        draw(ax, curves, points)


def draw(ax: Axes, curves: dict[str, tuple[np.ndarray, np.ndarray]], points: dict[str, tuple[float, float]]) -> None:
    for (name, (r, p)), style in zip(curves.items(), ("-", "--", "-", "--"), strict=False):
        ax.plot(r, p, style, label=name)
    for (name, (r, p)), marker in zip(points.items(), "osDv^P<>", strict=False):
        ax.plot([r], [p], marker, color="black", label=name, markersize=6, fillstyle="none")
    ax.set(xlabel="recall (duplicates served their own answer)", ylabel="precision (hits that are right)")
    ax.set(xlim=(0, 1), ylim=(0.4, 1.0), title="Semantic cache on QQP, test half")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")


def equal_recall(fit: Half, test: Half, fs: Served, ts: Served, points: list[np.ndarray], targets: list[float]):
    """At each target recall (reached on the fit half): the global threshold and the per-category
    thresholds chosen there, both reported on the test half."""
    thr, _, rec = curve(fit, fs)
    _, tp, tr = curve(test, ts)
    rows = []
    for r in (r for r in targets if len(rec) and r <= rec[-1]):
        g = np.full(len(test.queries), thr[np.argmax(rec >= r)])  # the highest threshold reaching r
        c = points[pick(fit, fs, points, r)][test.cat]
        (pg, rg, _), (pc, rc, _) = rates(test, ts, g), rates(test, ts, c)
        oracle = float(tp[tr >= rc].max()) if (tr >= rc).any() else 0.0
        lo, hi = delta_ci(test, ts, c, g)
        delta = f"{100 * (pc - pg):+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
        rows.append([f"{r:.2f}", f"{g[0]:.3f}", f"{pct(pg)} / {pct(rg)}", f"{pct(pc)} / {pct(rc)}", delta])
        rows[-1] += [pct(oracle), f"{100 * (pc - oracle):+.1f}"]
    return rows


def category_rows(config: SemanticCacheConfig, test: Half, ts: Served, fitted: np.ndarray, guarded: np.ndarray):
    ok = correct(test, ts)
    rows = []
    for i, c in enumerate(config.categories):
        m = test.cat == i
        hit = ts.score[m] >= fitted[i]
        tp = int((hit & ok[m]).sum())
        p, r = tp / max(int(hit.sum()), 1), tp / max(int(test.dup[m].sum()), 1)
        shown = [f"{t:.3f}" if t < NEVER else "never" for t in (fitted[i], guarded[i])]
        rows.append([c.name, str(int(m.sum())), str(int(test.dup[m].sum())), f"{c.threshold:.2f}", *shown])
        rows[-1].append(f"{pct(p)} / {pct(r)}")
    return rows


def wrong_hits(test: Half, s: Served, limit: np.ndarray) -> list[str]:
    """Wrong hits on a non-duplicate's own `a` (labelled wrong), on another pair's `a` (unlabelled: some
    are duplicates QQP never paired), and the precision over the labelled hits alone."""
    hit, own = s.score >= limit, s.entry == test.own
    right, labelled = int((hit & own & test.dup).sum()), int((hit & own).sum())
    return [str(labelled - right), str(int((hit & ~own).sum())), pct(right / max(labelled, 1))]


def pr_points(test: Half, s: Served, points: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    found = sorted((r, p) for p, r, _ in (rates(test, s, t[test.cat]) for t in points))
    return np.array([r for r, _ in found]), np.array([p for _, p in found])


Setting = tuple[np.ndarray, bool]  # a threshold per category; guards on


def settings_for(config: SemanticCacheConfig, fit: Half, f0: Served, f1: Served, points: tuple[list, list]):
    """The settings compared, thresholds fitted on the fit half; and the fit-half recall targeted."""
    ncat = len(config.categories)
    g = best_f1(fit, f0)
    target = rates(fit, f0, np.full(len(fit.queries), g))[1]
    chosen = pick(fit, f0, points[0], target)
    cat0, cat1 = points[0][chosen], points[1][chosen]  # with guards: the same cost λ
    shipped = np.array([c.threshold for c in config.categories])
    settings: dict[str, Setting] = {
        "categories.yaml thresholds": (shipped, False),
        "categories.yaml thresholds + guards": (shipped, True),
        "per-category, fitted": (cat0, False),
        "per-category, fitted, + guards": (cat0, True),
        "per-category, fitted with guards, + guards": (cat1, True),
        f"global {g:.3f} (best F1 on the fit half)": (np.full(ncat, g), False),
        f"global {g:.3f} + guards": (np.full(ncat, g), True),
        **{name: (np.full(ncat, t), False) for name, t in REFERENCES.items()},
    }
    return settings, target


def pr_section(
    config: SemanticCacheConfig,
    halves: tuple[Half, Half],
    served: list[Served],
    points: tuple[list, list],
    settings: dict[str, Setting],
    target: float,
    picture: Path,
    output: Path,
) -> str:
    """Precision and recall of every setting, equal-recall comparisons, the categories, and the plot."""
    fit, test = halves
    f0, f1, t0, t1 = served
    accuracy, marks = [], {}
    for name, (limits, guards) in settings.items():
        p, r, hits = rates(test, t1 if guards else t0, limits[test.cat])
        accuracy.append([name, pct(p), pct(r), pct(2 * p * r / max(p + r, 1e-9)), str(hits)])
        accuracy[-1] += wrong_hits(test, t1 if guards else t0, limits[test.cat])
        if "global" not in name:
            marks[name] = (r, p)
    targets = sorted({*RECALLS, round(target, 3)})
    recall_rows = [["no", *row] for row in equal_recall(fit, test, f0, t0, points[0], targets)]
    recall_rows += [["yes", *row] for row in equal_recall(fit, test, f1, t1, points[1], targets)]
    (_, p0, r0), (_, p1, r1) = curve(test, t0), curve(test, t1)
    curves = {"global threshold": (r0, p0), "global threshold + guards": (r1, p1)}
    curves["per-category (λ sweep)"] = pr_points(test, t0, points[0])
    curves["per-category + guards (λ sweep with guards)"] = pr_points(test, t1, points[1])
    plot(picture, curves, marks)
    cat0, cat1 = settings["per-category, fitted"][0], settings["per-category, fitted with guards, + guards"][0]
    return (
        "### Precision and recall\n\n"
        "Wrong hits are of two kinds: the asking pair's own `a` when the pair is not a duplicate (labelled "
        "wrong), and another pair's `a` (unlabelled; some are paraphrases QQP never paired, so the precision "
        "is a lower bound; the last column leaves them out). "
        "Fitted per-category thresholds: in each category the threshold maximising TP − λ·FP on the fit half, "
        f"with the λ whose fit-half recall reaches {pct(target)}% (that of the best-F1 global threshold there) "
        "at the best fit-half precision; fitted with guards: the same λ over the scores with guards.\n\n"
        + table(
            ["setting", "precision %", "recall %", "F1 %", "hits", "wrong: own `a`", "wrong: other"]
            + ["precision, labelled hits %"],
            accuracy,
        )
        + "\n\nEqual recall: for each target recall, the global threshold and the per-category thresholds that "
        "reach it on the fit half, both on the test half. ΔP: per-category − global precision (points), 95% "
        "bootstrap interval over test questions. The last two columns set the per-category result against "
        "the test half's own global curve at the same test recall (a threshold chosen on the test half itself, "
        "which favours the global one). Targets beyond the fit half's reach are left out.\n\n"
        + table(
            ["guards", "target recall", "global threshold", "global P / R %", "per-category P / R %", "ΔP"]
            + ["global curve's P at that R %", "per-category − that"],
            recall_rows,
        )
        + "\n\nCategories of the test half's questions, and their thresholds.\n\n"
        + table(
            ["category", "questions", "duplicates", "categories.yaml", "fitted", "fitted with guards"]
            + ["fitted: P / R %"],
            category_rows(config, test, t0, cat0, cat1),
        )
        + f"\n\n{image(picture, output, 'precision-recall, test half')}"
    )


def bench_semantic(
    data: Path,
    limit: int,
    per_type: int,
    sizes: list[int],
    queries: int,
    asked: int,
    settings: Settings,
    output: Path,
    command: str,
    fit_verifier: Path | None = None,
    plots: Path | None = None,
) -> None:
    """`fit_verifier`: fit the verifier on the fit half, write it there and measure it (else the shipped one);
    `plots`: the folder of the figure (None: beside `output`)."""
    began, cache_dir = time.perf_counter(), settings.cache_dir
    if per_type < 1 or queries < 1 or not sizes or min(sizes) < 1 or asked < 0:
        raise DataError("--traps, --queries and --sizes must be at least 1, --gateway at least 0")
    pairs = load_pairs(data, limit)
    embedder, config = MiniLM(), SemanticCacheConfig()
    classify = Classifier(config, embedder)
    vecs = embed_cached(embedder, [p[0] for p in pairs] + [p[1] for p in pairs], cache_dir)
    a, b = vecs[: len(pairs)], vecs[len(pairs) :]
    split = np.array_split(np.random.default_rng(SEED).permutation(len(pairs)), 2)
    fit, test = (make_half(pairs, a, b, np.sort(rows), classify) for rows in split)
    if fit_verifier is not None:
        fit_on(pairs, a, b, np.sort(split[0]), classify).save(fit_verifier)
    verifier = Verifier.load(fit_verifier or SHIPPED)
    served = [serve(h.queries, h.qvecs, h.stored, h.svecs, g) for h in (fit, test) for g in (False, True)]
    points = sweep(fit, served[0], len(config.categories)), sweep(fit, served[1], len(config.categories))
    compared, target = settings_for(config, fit, served[0], served[1], points)
    picture = (plots or output.parent) / "semantic-pr.png"
    embed = partial(embed_cached, embedder, cache_dir=cache_dir)
    traps = traps_for(test, per_type, embed, classify)
    body = (
        f"{len(pairs)} QQP pairs (the first {len(pairs)} rows of `{data.name}`, {sum(p[2] for p in pairs)} "
        f"duplicates), embedded with {embedder.name} (both sides, once; kept in the cache dir). Split at random "
        f"(seed {SEED}) into a fit half and a test half. Each half is a cache: its distinct `a` questions are the "
        "entries, each `b` asks (pairs whose `b` is verbatim a stored question are left out: "
        f"{fit.left_out} fit, {test.left_out} test). Nearest entries are exact (numpy cosine), not hnswlib. A hit "
        "is right when the entry served is the pair's own `a` and the pair is a duplicate; precision = right "
        f"hits / hits, recall = right hits / duplicates. With guards, up to {config.candidates} nearest entries "
        "are tried in order and the first no guard refuses is served, as `SemanticCache.find` does. Categories "
        "come from `policy.Classifier` on the asking side. Thresholds are chosen on the fit half; every number "
        f"below is on the test half ({len(test.queries)} questions, {int(test.dup.sum())} duplicates).\n\n"
        + pr_section(config, (fit, test), served, points, compared, target, picture, output)
        + "\n\n"
        + section(test, served[2], served[3], traps, compared, compared["per-category, fitted"][0])
        + "\n\n"
        + bound_section(test, traps, [c.name for c in config.categories], verifier)
        + "\n\n"
        + latency_section(embedder, *latency_pool(pairs, a, b, queries), sizes)
        + gateway_section(settings, pairs, test, asked)
        + f"\n\nTook {time.perf_counter() - began:.0f} s."
    )
    write_section(output, "semantic", "Semantic cache: hits, traps and latency on QQP", command, body)
    print(body, flush=True)
