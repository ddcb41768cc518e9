"""Writes kvgate's Grafana dashboards (kvgate-server.json, kvgate-fleet.json) from their definitions here:
edit server_dashboard.py or fleet_dashboard.py, then run `python deploy/grafana/build.py`.
`--check` writes nothing and fails when a JSON file differs from what its definition makes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the definitions beside this file, also under PYTHONSAFEPATH

import fleet_dashboard  # noqa: E402
import server_dashboard  # noqa: E402

BUILT = {"kvgate-server.json": server_dashboard.build, "kvgate-fleet.json": fleet_dashboard.build}


def text(name: str) -> str:
    return json.dumps(BUILT[name](), indent=2) + "\n"


def main(argv: list[str]) -> int:
    stale = [name for name in BUILT if not (HERE / name).exists() or (HERE / name).read_text() != text(name)]
    if "--check" in argv:
        for name in stale:
            print(f"{name} differs from its definition: run python deploy/grafana/build.py", file=sys.stderr)
        return 1 if stale else 0
    for name in stale:
        (HERE / name).write_text(text(name))
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
