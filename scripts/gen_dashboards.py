"""Write pitstop's Grafana dashboards (deploy/grafana/dashboards/*.json) from the panels
described here, so every query lives in one reviewable place.

    python scripts/gen_dashboards.py          # rewrite the JSON files
    python scripts/gen_dashboards.py --check  # exit 1 if the checked-in files are stale

Three dashboards over the scheduler's and agents' /metrics: the fleet (node states, GPU
health and Xids, the control plane's heartbeat and event-loop lag), a job (step rate,
tokens/s, loss, MFU, step time, stragglers, goodput) and recoveries (by cause, time by
phase, steps lost, goodput). Each picks its Prometheus data source from a variable, so
the files import as they are (Grafana's provisioning, or Dashboards > Import).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: scripts.* from the root
from scripts._dashboards_fleet import fleet
from scripts._dashboards_jobs import job, recovery

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana" / "dashboards"
DASHBOARDS = {"fleet.json": fleet, "job.json": job, "recovery.json": recovery}


def render() -> dict[str, str]:
    """Each dashboard file's name and text."""
    return {
        name: json.dumps(build().to_json(), indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON files are stale")
    args = parser.parse_args()
    fresh = render()
    if args.check:
        stale = sorted(
            name
            for name, text in fresh.items()
            if not (OUT / name).is_file() or (OUT / name).read_text() != text
        )
        if stale:
            print(
                "Grafana dashboards are stale: " + ", ".join(stale) + "\n"
                "fix: run `python scripts/gen_dashboards.py` and commit the result",
                file=sys.stderr,
            )
            return 1
        print(f"Grafana dashboards are fresh ({len(fresh)} files)")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in fresh.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(fresh)} dashboards to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
