"""deploy/grafana's dashboards are importable Grafana dashboards over kvgate's metrics, as their definitions make
them; deploy/prometheus's example scrapes kvgate; tests/helpers/dashboards.py reads PromQL's selectors. (That each
panel has data after load: tests/server/test_load.py, test_fleet.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.dashboards import (
    DASHBOARDS,
    FLEET,
    SERVER,
    STRING,
    Matcher,
    Selector,
    load,
    panels,
    queries,
    selectors,
)

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RANGE = re.compile(r"\[([^\]]*)\]")


def test_the_json_files_are_what_their_definitions_make():
    built = subprocess.run(
        [sys.executable, str(DASHBOARDS / "build.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr


@pytest.mark.parametrize("path", [SERVER, FLEET], ids=lambda p: p.name)
def test_each_dashboard_imports_into_a_fresh_grafana(path: Path):
    """The data source is a variable (chosen on import, no __inputs to fill), every panel and target reads it,
    panel ids are unique and panels do not overlap on the grid."""
    dashboard = load(path)
    assert dashboard["uid"] == path.stem and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"job", "instance"} <= set(variables)
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DS, variable["name"]
    every = list(panels(dashboard))
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), ids
    cells: dict[tuple[int, int], str] = {}
    for panel in every:
        x, y, w, h = (panel["gridPos"][k] for k in "xywh")
        assert 0 <= x and x + w <= 24, panel["title"]
        for cell in ((i, j) for i in range(x, x + w) for j in range(y, y + h)):
            assert cell not in cells, f"{panel['title']!r} overlaps {cells[cell]!r}"
            cells[cell] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DS and panel["targets"] and panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DS and target["expr"].strip(), panel["title"]


@pytest.mark.parametrize("path", [SERVER, FLEET], ids=lambda p: p.name)
def test_every_query_is_filtered_by_the_variables_and_rates_over_the_rate_interval(path: Path):
    dashboard = load(path)
    defined = {v["name"] for v in dashboard["templating"]["list"]} | {"__rate_interval"}
    for where, expr in queries(dashboard):
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert used <= defined, f"{where}: {used - defined}"
        windows = RANGE.findall(STRING.sub('""', expr))  # label values may hold brackets: [45]..
        assert all(w == "$__rate_interval" for w in windows), f"{where}: {expr}"
        found = selectors(expr)
        assert found, f"{where}: no metric in {expr}"
        for selector in found:
            assert selector.name.startswith(("kvgate_", "process_")), f"{where}: {selector}"
            if where.startswith("panel"):
                filtered = {m.label for m in selector.matchers if "$" in m.value}
                assert {"job", "instance"} <= filtered or selector.name.startswith("process_"), f"{where}: {selector}"


def test_the_scrape_example_scrapes_metrics_with_the_admin_key():
    config = yaml.safe_load((DASHBOARDS.parent / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvgate", "kvgate-replicas"}
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
        assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]


def test_selectors_are_read_from_promql():
    expr = (
        'histogram_quantile(0.9, sum by (le, route) (rate(a_bucket{job=~"$job", route!~"/v1/.*"}[$__rate_interval])))'
        ' / on (route) group_left b{x="y,}z"} offset 5m > bool 0.5 and ignoring(le) c unless sum without (d) (e)'
        ' * label_replace(f, "dst", "$1", "src", "(.*)") or max(g) by (h) - 1e3 + Inf'
    )
    assert selectors(expr) == [
        Selector("a_bucket", (Matcher("job", "=~", "$job"), Matcher("route", "!~", "/v1/.*"))),
        Selector("b", (Matcher("x", "=", "y,}z"),)),
        Selector("c", ()),
        Selector("e", ()),
        Selector("f", ()),
        Selector("g", ()),
    ]
    assert selectors('label_values(kvgate_requests_total{job=~"$job"}, instance)') == [
        Selector("kvgate_requests_total", (Matcher("job", "=~", "$job"),))
    ]


def test_a_selector_matches_samples_as_prometheus_would_and_any_value_of_a_variable():
    selector = selectors('m{job=~"$job", status=~"4..", route!="/x", worker=""}')[0]
    assert selector.matches("m", {"status": "429", "route": "/v1/chat/completions"})
    assert not selector.matches("m", {"status": "4290"})  # a regex matches the whole value
    assert not selector.matches("m", {"status": "500"})
    assert not selector.matches("m", {"status": "404", "route": "/x"})
    assert not selector.matches("m", {"status": "404", "worker": "worker-0"})  # "": the label absent
    assert not selector.matches("m_total", {"status": "404"})
