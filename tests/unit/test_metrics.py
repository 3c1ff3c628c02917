"""The metric definitions register together and each one records and shows up in the exposition."""

from __future__ import annotations

from pipesvc.observe import metrics as metrics_module
from pipesvc.observe.metrics import PrometheusMetrics


def _labels(names: tuple[str, ...]) -> dict[str, str]:
    return {name: "x" for name in names}


def test_every_definition_records_under_its_own_name() -> None:
    metrics = PrometheusMetrics()  # raises if two definitions map to one exposed name
    for name, (kind, _, labels) in metrics_module._DEFINITIONS.items():
        if kind == "counter":
            metrics.inc(name, 2.0, **_labels(labels))
        elif kind == "gauge":
            metrics.set(name, 3.0, **_labels(labels))
        else:
            metrics.observe(name, 0.01, **_labels(labels))
    text = metrics.text()
    for name, (kind, _, _) in metrics_module._DEFINITIONS.items():
        exposed = f"pipesvc_{name}".removesuffix("_total")
        suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}[kind]
        assert f"\n{exposed}{suffix}" in text or text.startswith(f"{exposed}{suffix}"), name
