"""Generate a Prometheus scrape config for a running (or held) testbed deployment.

    python examples/observability/scrape_config.py RUN_DIR [-o OUT_DIR]

reads RUN_DIR/deployment.json (every service's address; node ports change with every hold) and
writes OUT_DIR/prometheus.yml and OUT_DIR/targets.json (file_sd; default OUT_DIR: RUN_DIR/prometheus).
Run it again for the next hold with the same OUT_DIR: a Prometheus already running on that
prometheus.yml rereads targets.json within seconds. `--prometheus` on `testbed up --hold` and
`testbed replay` does this and runs Prometheus itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from testbed.deploy.prometheus import write_scrape_config
from testbed.live.deployment import Deployment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run directory holding deployment.json")
    p.add_argument("-o", "--out", type=Path, help="where to write prometheus.yml and targets.json")
    args = p.parse_args()
    dep = Deployment.read(args.run_dir / "deployment.json")
    cfg = write_scrape_config(dep, args.out or args.run_dir / "prometheus")
    print(f"prometheus --config.file={cfg}")


if __name__ == "__main__":
    main()
