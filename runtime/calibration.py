"""A model's calibrated blend ratio, chosen by `kvgate calibrate` and used when serving."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvgate.chunk_cache import fingerprint
from kvgate.runtime.loader import LoadedModel, file_digest, weight_files, write_atomic
from kvgate.runtime.reuse import tokenizer_fingerprint

log = logging.getLogger("kvgate.calibration")

# The fidelity metrics a target may be set on, and whether a larger value is better.
METRICS = {"top1": True, "kl": False}


@dataclass(frozen=True)
class Calibration:
    ratio: float  # the smallest recompute ratio that met the target
    deviation_limit: float | None  # a request deviating more than this gets a larger ratio
    target: float
    metric: str
    items: int
    curve: dict[str, float] = field(default_factory=dict)  # ratio -> measured metric
    # Per number of documents calibrated, per ratio: the measured {"kl", "top1"}.
    table: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    select: str = "deviation"  # how the blends measured chose the tokens they recomputed (`caches.blend_select`)
    document_kv: str = "alone"  # the documents' KV as reused: computed alone, or in another prompt ("context")

    def ratio_for(self, documents: int, target_kl: float, target_top1: float) -> tuple[float | None, str]:
        """The smallest calibrated ratio that met both targets on prompts of as many documents
        (the nearest count calibrated at or above, else the largest); None and why when none did.
        Without a table: the one calibrated ratio."""
        if not self.table:
            return self.ratio, ""
        count = self.count(documents)
        rows = sorted((float(r), m) for r, m in self.table[str(count)].items())
        for ratio, m in rows:
            if m["kl"] <= target_kl and m["top1"] >= target_top1:
                return ratio, ""
        r, m = max(rows, key=lambda row: row[1]["top1"])
        return None, (
            f"no calibrated recompute ratio meets the fidelity target (KL <= {target_kl:g}, top-1 >= "
            f"{target_top1:.0%}) for {count} documents; the best, {r:.0%}, had KL {m['kl']:.3f}, top-1 {m['top1']:.1%}"
        )

    def count(self, documents: int) -> int:
        """The number of documents calibrated that stands for `documents`: the nearest at or above, else the largest."""
        counts = sorted(int(d) for d in self.table)
        return next((c for c in counts if c >= documents), counts[-1])

    def measured(self, documents: int, ratio: float) -> dict[str, float] | None:
        """The mean first-token {"kl", "top1"} calibration measured at `ratio` for as many documents."""
        return self.table[str(self.count(documents))].get(f"{ratio:g}") if self.table else None


def model_fingerprint(loaded: LoadedModel) -> str:
    """What the model computes, never where it lies: the bytes of its config and weights (for a GGUF,
    those of the safetensors it was converted to, which are what is loaded), its tokenizer, chat
    template and end-of-sequence ids, and the dtype it runs in. New weights at an old path are a
    new model: they never meet the old one's document KV, semantic answers or calibration."""
    files = [
        part
        for f in weight_files(loaded.path)
        for part in (f.name, config_digest(f) if f.name == "config.json" else file_digest(f, loaded.cache_dir))
    ]
    template = json.dumps([loaded.tokenizer.chat_template, sorted(loaded.eos_token_ids)], sort_keys=True)
    dtype = str(loaded.model.dtype)
    return fingerprint("kvgate.model.v3", *files, tokenizer_fingerprint(loaded.tokenizer), template, dtype)


def config_digest(path: Path) -> str:
    """The config's content without the version of transformers that wrote it: each release writes its own into the
    same model's config (transformers 5.24 and 5.25 converted the default GGUF to byte-identical weights and configs
    differing in that field alone), which would make a new model of it, and miss every calibration shipped."""
    config = json.loads(path.read_text())
    config.pop("transformers_version", None)
    return fingerprint(json.dumps(config, sort_keys=True))


def name(model_fp: str, select: str = "deviation") -> str:
    """A calibration's file name: per model, and per way of selecting tokens (a table measured for one
    selection says nothing of another's)."""
    return f"{model_fp[:16]}.json" if select == "deviation" else f"{model_fp[:16]}-{select}.json"


def path(cache_dir: Path, model_fp: str, select: str = "deviation") -> Path:
    return Path(cache_dir) / "calibration" / name(model_fp, select)


SHIPPED = Path(__file__).parent / "calibrations"  # what `kvgate calibrate` measured for the models kvgate ships


def find(cache_dir: Path, model_fp: str, shipped: bool = True, select: str = "deviation") -> Calibration | None:
    """The model's calibration for blends selecting by `select`: the one `kvgate calibrate` made here,
    else (`shipped`) the one kvgate ships for it (the same weights in the same dtype: the fingerprint says
    so), else none."""
    own = load(path(cache_dir, model_fp, select))
    return own or (load(SHIPPED / name(model_fp, select)) if shipped else None)


def save(cal: Calibration, where: Path) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    write_atomic(where, json.dumps(asdict(cal), indent=2))


def load(where: Path) -> Calibration | None:
    """None when there is none; a damaged file is logged and counts as none."""
    if not where.is_file():
        return None
    try:
        cal = Calibration(**json.loads(where.read_text()))
        if not 0.0 <= cal.ratio <= 1.0:
            raise ValueError(f"ratio {cal.ratio} outside [0, 1]")
        if cal.document_kv not in ("alone", "context"):
            raise ValueError(f"document_kv {cal.document_kv!r}: alone or context")
        if cal.deviation_limit is not None and not cal.deviation_limit >= 0.0:
            raise ValueError(f"deviation limit {cal.deviation_limit} is not a non-negative number")
        for count, rows in cal.table.items():
            if int(count) < 1 or not rows:
                raise ValueError(f"table row for {count!r} documents")
            for ratio, m in rows.items():
                if not 0.0 <= float(ratio) <= 1.0 or not {"kl", "top1"} <= set(m):
                    raise ValueError(f"table entry {ratio!r} for {count} documents")
        return cal
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring the calibration in %s: %s", where, exc)
        return None


def meets(value: float, target: float, metric: str) -> bool:
    if math.isnan(value):
        return False
    return value >= target if METRICS[metric] else value <= target


def pick_ratio(curve: dict[float, float], target: float, metric: str) -> tuple[float, bool]:
    """The smallest ratio whose measured `metric` meets `target`, and True; when none does, the
    largest ratio measured, and False."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    if not curve:
        raise ValueError("an empty curve")
    for ratio in sorted(curve):
        if meets(curve[ratio], target, metric):
            return ratio, True
    return max(curve), False
