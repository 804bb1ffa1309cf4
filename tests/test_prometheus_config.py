"""The scrape config generated from a deployment: every service a target, labelled for the
dashboards, and a one-line refusal where `--prometheus` cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from testbed.config.scenarios import load_scenario
from testbed.deploy.plan import loopback_deployment
from testbed.deploy.prometheus import scrape_targets, unavailable, write_scrape_config
from testbed.run.load import resolve

pytestmark = pytest.mark.pure


def test_every_service_is_a_labelled_target(tmp_path: Path) -> None:
    dep = loopback_deployment(resolve(load_scenario("paper-prfaas")), None)
    groups = scrape_targets(dep)
    by_target = {g["targets"][0]: g["labels"] for g in groups}
    assert len(by_target) == 1 + len(dep.nodes) == 13
    assert by_target[f"{dep.router.host}:{dep.router.port}"] == {"role": "router"}
    for n in dep.nodes.values():
        labels = by_target[f"{n.http.host}:{n.http.port}"]
        assert labels["role"] == n.role and labels["cluster"] == n.cluster
        assert labels["cluster_kind"] == ("prfaas" if n.cluster == "prfaas" else "pd")
    cfg = yaml.safe_load(write_scrape_config(dep, tmp_path / "prom").read_text())
    sd = cfg["scrape_configs"][0]["file_sd_configs"][0]["files"][0]
    assert json.loads(Path(sd).read_text()) == groups


def test_prometheus_is_refused_in_one_line_where_it_cannot_run() -> None:
    assert unavailable("local", "/usr/bin/prometheus") is None
    assert unavailable("inproc", "/usr/bin/prometheus") is None
    for why in (unavailable("local", None), unavailable("compose", "/usr/bin/prometheus"), unavailable("sim", None)):
        assert why is not None and why.startswith("--prometheus: ") and "\n" not in why
