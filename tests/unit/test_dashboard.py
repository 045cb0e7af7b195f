"""The provisioned Grafana dashboard is valid JSON and asks only for metrics the services
export; the Prometheus config scrapes every service."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

import pdserve.shared.metrics  # noqa: F401 - registers every metric

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def exported() -> set[str]:
    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("pd_"):
            names |= {family.name} | {s.name for s in family.samples}
    return names


def test_the_dashboard_refers_only_to_exported_metrics():
    dash = json.loads((COMPOSE / "grafana" / "dashboards" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bpd_[a-z0-9_]+", e)}
    have = exported()
    missing = sorted(m for m in used if m not in have and not any(m.removesuffix(s) in have for s in SUFFIXES))
    assert not missing, missing
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("first token", "inter-token", "gb/s", "queue", "kv cache", "outcome"):
        assert topic in titles, topic
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_prometheus_scrapes_every_service():
    cfg = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in cfg["scrape_configs"]} == {"gateway", "router", "prefill", "decode", "issuer"}

