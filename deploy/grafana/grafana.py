"""Grafana's JSON for kvgate's dashboards: panels laid out in rows, PromQL built from a few shapes, and the
variables every dashboard has (the Prometheus data source, chosen on import or later, and job and instance).
Targets Grafana 10 and later (schemaVersion 39)."""

from __future__ import annotations

from typing import Any

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RATE = "[$__rate_interval]"
WIDTH, HEIGHT = 24, 8  # the grid's width, and each panel's height
Target = tuple[str, str]  # (PromQL, legend)


def rate(metric: str, where: str, by: str = "") -> str:
    """Per second over Grafana's rate interval, summed (by `by`)."""
    grouped = f" by ({by})" if by else ""
    return f"sum{grouped} (rate({metric}{{{where}}}{RATE}))"


def share(part: str, whole: str) -> str:
    return f"({part})\n/\n({whole})"


def quantiles(histogram: str, where: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Target]:
    return [(f"histogram_quantile({q}, {rate(histogram + '_bucket', where, 'le')})", f"p{round(q * 100)}") for q in qs]


def panel(
    title: str,
    description: str,
    unit: str,
    targets: list[Target],
    width: int = 8,
    kind: str = "timeseries",
    **options: Any,
) -> dict[str, Any]:
    """A panel, its id and place given by `dashboard`. `options` go into the panel's options (stat, heatmap)."""
    defaults: dict[str, Any] = {"unit": unit}
    if kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "fillOpacity": 10, "lineWidth": 1, "showPoints": "never"}
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
            **options,
        }
    if unit == "percentunit":
        defaults |= {"min": 0, "max": 1}
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"w": width, "h": HEIGHT},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + n), "range": True}
            | ({"format": "heatmap"} if kind == "heatmap" else {})
            for n, (expr, legend) in enumerate(targets)
        ],
    }


def state(title: str, description: str, targets: list[Target], width: int = 8) -> dict[str, Any]:
    """A stat panel naming the series that is on (its legend), for a gauge that is 1 for one label value."""
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    return panel(title, description, "none", targets, width, "stat", reduceOptions=reduce, textMode="name")


def heatmap(title: str, description: str, histogram: str, where: str, width: int = 8) -> dict[str, Any]:
    expr = f"sum by (le) (increase({histogram}_bucket{{{where}}}{RATE}))"
    options = {
        "calculate": False,
        "yAxis": {"unit": "s"},
        "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
        "cellGap": 1,
    }
    return panel(title, description, "short", [(expr, "{{le}}")], width, "heatmap", **options)


def variable(name: str, label: str, query: str, hide: int = 0) -> dict[str, Any]:
    """A multi-value query variable over label values, "All" by default."""
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,  # on each time range change: new instances show up
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": hide,
    }


def datasource() -> dict[str, Any]:
    return {
        "type": "datasource",
        "name": "DS_PROMETHEUS",
        "label": "Prometheus",
        "query": "prometheus",
        "current": {},
        "refresh": 1,
        "hide": 0,
    }


def dashboard(
    uid: str, title: str, description: str, variables: list[dict[str, Any]], rows: list[tuple[str, list[dict]]]
) -> dict[str, Any]:
    """The dashboard: each row a header, then its panels left to right, wrapping at the grid's width."""
    laid: list[dict[str, Any]] = []
    y = 0
    for name, members in rows:
        laid.append(
            {"type": "row", "title": name, "collapsed": False, "panels": [], "gridPos": gridpos(0, y, WIDTH, 1)}
        )
        y, x = y + 1, 0
        for member in members:
            w = member["gridPos"]["w"]
            if x + w > WIDTH:
                y, x = y + HEIGHT, 0
            laid.append({**member, "gridPos": gridpos(x, y, w, HEIGHT)})
            x += w
        y += HEIGHT
    for n, member in enumerate(laid, 1):
        member["id"] = n
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvgate"],
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "links": [],
        "annotations": {"list": []},
        "templating": {"list": [datasource(), *variables]},
        "panels": laid,
    }


def gridpos(x: int, y: int, w: int, h: int) -> dict[str, int]:
    return {"x": x, "y": y, "w": w, "h": h}
