"""Reading a local cluster's coordinator metrics (started with ``--metrics-port 0``)."""

from __future__ import annotations

import re
import urllib.request

import pipesvc

_METRICS_URL = re.compile(r"serving Prometheus metrics on (http://\S+/metrics)")


def coordinator_metric(cluster: pipesvc.LocalCluster, name: str) -> float:
    """The coordinator's ``pipesvc_<name>`` (a metric without labels)."""
    text = (cluster.log_dir / "coordinator.log").read_text(errors="replace")
    found = _METRICS_URL.search(text)
    assert found is not None, "the coordinator did not log its metrics address"
    with urllib.request.urlopen(found[1], timeout=10) as reply:
        metrics = reply.read().decode()
    value = re.search(rf"^pipesvc_{name} (\S+)$", metrics, re.MULTILINE)
    assert value is not None, f"the coordinator has no pipesvc_{name}"
    return float(value[1])
