"""docs/grafana/duetserve.json queries only series the server and the router export:
every `duet:` / `duet_router:` name in its PromQL is a sample name of ServerMetrics,
KVTransferMetrics or the router's registry (so a renamed metric fails here, not on an
operator's empty panel)."""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from fastapi.testclient import TestClient
from duetserve.entrypoints.router.app import build_app
from duetserve.entrypoints.router.policy import Policy
from duetserve.entrypoints.router.pool import InstancePool
from duetserve.metrics.kv_transfer import KVTransferMetrics
from duetserve.metrics.prometheus import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "duetserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",)}


def sample_names(text: str) -> set[str]:
    """Every sample name the exposition can hold, from its `# TYPE` lines."""
    names = set()
    for kind_line in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        name, kind = kind_line
        if kind == "counter":            # the TYPE line may or may not carry _total
            name = name.removesuffix("_total")
        names.update(name + s for s in SUFFIXES.get(kind, ("",)))
    return names


def exported_names() -> set[str]:
    metrics = ServerMetrics("m", 2048, 512)
    KVTransferMetrics(metrics.registry, "m", "decode", threading.Lock())
    names = sample_names(metrics.render().decode())
    router = TestClient(build_app(InstancePool([], True, 2.0), Policy("round_robin"),
                                  Policy("round_robin")))   # no lifespan: no health loop
    names |= sample_names(router.get("/metrics").text)
    return names


def panels(dash: dict):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def test_dashboard_queries_exported_series_only() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    used = {n for e in exprs for n in re.findall(r"duet(?:_router)?:[a-z0-9_]+", e)}
    known = exported_names()
    assert len(used) >= 25
    assert used <= known, sorted(used - known)
    # The phase split, the thesis of the engine, is on the first row.
    first = next(p for p in panels(dash) if p["type"] == "timeseries")
    assert "prefill" in first["title"] and "decode" in first["title"]


def test_dashboard_layout_is_valid() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]
