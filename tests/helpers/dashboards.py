"""The Grafana dashboards under deploy/grafana against a server's `/metrics`: their panels, the metric selectors
of each panel's PromQL (parsed just far enough: names and label matchers, outside function names, keywords,
label lists and ranges), and which of those no scraped sample matches. Matchers on a template variable
(`instance=~"$instance"`) are Prometheus's labels or the operator's choice: they match anything here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import loopback

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
SERVER, FLEET = DASHBOARDS / "kvgate-server.json", DASHBOARDS / "kvgate-fleet.json"

AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
}  # fmt: skip
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}
LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}  # each may be followed by (label, ...)
LITERALS = {"inf", "nan"}
NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
NUMBER = re.compile(r"0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?[a-zA-Z]*")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')\s*,?')
VARIABLE = re.compile(r"\$(?:\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")
LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.S)


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # =, !=, =~, !~
    value: str

    def holds(self, labels: dict[str, str]) -> bool:
        if "$" in self.value:  # a template variable: any value
            return True
        have = labels.get(self.label, "")
        if self.op in ("=", "!="):
            return (have == self.value) == (self.op == "=")
        return (re.fullmatch(self.value, have) is not None) == (self.op == "=~")


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[Matcher, ...]

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        return name == self.name and all(m.holds(labels) for m in self.matchers)

    def __str__(self) -> str:
        return self.name + "{" + ", ".join(f"{m.label}{m.op}{m.value!r}" for m in self.matchers) + "}"


def unquote(text: str) -> str:
    return json.loads(text) if text.startswith('"') else text[1:-1]


def skip_space(expr: str, i: int) -> int:
    while i < len(expr) and expr[i].isspace():
        i += 1
    return i


def closing(expr: str, i: int, close: str) -> int:
    """The index after the bracket `close` that ends the group opened just before `i`."""
    depth = 1
    while i < len(expr):
        if expr[i] in "\"'`":
            i = STRING.match(expr, i).end()  # type: ignore[union-attr]
            continue
        depth += expr[i] in "([{"
        depth -= expr[i] in ")]}"
        i += 1
        if depth == 0:
            if expr[i - 1] != close:
                raise ValueError(f"unbalanced {close!r} at {i - 1} in {expr!r}")
            return i
    raise ValueError(f"unclosed {close!r} in {expr!r}")


def matchers(expr: str, i: int) -> tuple[tuple[Matcher, ...], int]:
    """The label matchers of the braces opened just before `i`, and the index after their closing brace."""
    found = []
    while True:
        i = skip_space(expr, i)
        if expr[i] == "}":
            return tuple(found), i + 1
        m = MATCHER.match(expr, i)
        if m is None:
            raise ValueError(f"not a label matcher at {i} in {expr!r}")
        found.append(Matcher(m[1], m[2], unquote(m[3])))
        i = m.end()


def selectors(expr: str) -> list[Selector]:
    """Every metric selector in a PromQL expression (or a Grafana `label_values(selector, label)` query)."""
    if shown := LABEL_VALUES.match(expr):
        return selectors(shown[1])
    found: list[Selector] = []
    i = 0
    while (i := skip_space(expr, i)) < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = STRING.match(expr, i).end()  # type: ignore[union-attr]
        elif c == "[":  # a range or a subquery's window: $__rate_interval, 5m, 1h:1m
            i = closing(expr, i + 1, "]")
        elif c == "{":
            raise ValueError(f"a selector without a metric name at {i} in {expr!r}")
        elif (m := NAME.match(expr, i)) is not None:
            word, i = m[0], m.end()
            after = skip_space(expr, i)
            called = after < len(expr) and expr[after] == "("
            if word in LISTS:
                if called:
                    i = closing(expr, after + 1, ")")
            elif word == "offset":
                i = NUMBER.match(expr, after).end()  # type: ignore[union-attr]
            elif word in KEYWORDS or word.lower() in LITERALS or word in AGGREGATIONS or called:
                continue  # a keyword, a literal, or a function or aggregation: its arguments are read next
            elif after < len(expr) and expr[after] == "{":
                labels, i = matchers(expr, after + 1)
                found.append(Selector(word, labels))
            else:
                found.append(Selector(word, ()))
        elif (m := NUMBER.match(expr, i)) is not None and m.end() > i:
            i = m.end()
        elif (m := VARIABLE.match(expr, i)) is not None:  # a Grafana variable outside a string: not a metric
            i = m.end()
        else:
            i += 1  # operators, commas, parentheses
    return found


# --- dashboards ----------------------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and those a collapsed row holds."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} ({target['refId']})", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable ${variable['name']}", query["query"] if isinstance(query, dict) else query


# --- against a scrape ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def samples(*texts: str) -> list[Sample]:
    """The samples of Prometheus texts (several processes' scrapes: what one Prometheus would hold)."""
    families = [f for text in texts for f in text_string_to_metric_families(text)]
    return [Sample(s.name, s.labels, s.value) for f in families for s in f.samples]


def value(scraped: Iterable[Sample], name: str, **labels: str) -> float | None:
    """The value of the sample of that name with exactly those labels; None if there is none."""
    return next((s.value for s in scraped if s.name == name and s.labels == labels), None)


def unmatched(dashboard: dict[str, Any], scraped: Iterable[Sample]) -> list[str]:
    """Each selector of the dashboard's queries that matches no sample, with where it is."""
    scraped = list(scraped)
    return [
        f"{where}: {selector}"
        for where, expr in queries(dashboard)
        for selector in selectors(expr)
        if not any(selector.matches(s.name, s.labels) for s in scraped)
    ]


def scraped(url: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a server's /metrics now (None: not there)."""
    return value(samples(loopback.get(url + "/metrics").text), name, **labels)
