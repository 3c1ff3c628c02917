"""Metrics: a small interface with a no-op default and a Prometheus implementation.

Names (all prefixed ``pipesvc_``) and labels are fixed in ``_DEFINITIONS``; code records
through ``Metrics.inc``/``observe``/``set`` and never touches prometheus_client directly.
"""

from __future__ import annotations

from typing import Any

_DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # name: (kind, help, labels)
    "steps_committed_total": ("counter", "Training steps committed", ()),
    "steps_aborted_total": ("counter", "Runs aborted on every stage", ()),
    "runs_sent_ahead_total": (
        "counter",
        "Training runs sent to the stages before the step they follow was decided",
        (),
    ),
    "recoveries_total": ("counter", "Recoveries from lost stages or failed steps", ()),
    "step_seconds": ("histogram", "Wall time of a training step, commit included", ()),
    "runs_total": ("counter", "Runs a stage executed", ("mode",)),
    "action_seconds": ("histogram", "Compute time of one schedule action", ("action",)),
    "wait_seconds": ("histogram", "Time a stage waited for an input or gradient", ("kind",)),
    "bytes_total": ("counter", "Tensor payload bytes on the data plane", ("direction", "kind")),
    "frames_total": ("counter", "Frames on the data plane", ("direction", "kind")),
    "queue_depth": ("gauge", "Items waiting in a stage queue", ("queue",)),
    "microbatches_in_flight": ("gauge", "Micro-batches whose activations are alive", ()),
    "bubble_fraction": ("gauge", "Idle share of the stage's last training run", ()),
    "generation_sessions_total": ("counter", "Generation sessions started", ()),
    "generation_replays_total": (
        "counter",
        "Generation sessions that replayed their tokens after a stage lost their caches",
        (),
    ),
    "generation_evictions_total": (
        "counter",
        "Generation sessions whose caches were dropped to wait for room in the KV budgets",
        (),
    ),
    "generated_tokens_total": ("counter", "Tokens generated (one per row per step)", ()),
    "prefix_hits_total": (
        "counter",
        "Generation sessions that started from a prompt prefix the stages kept",
        (),
    ),
    "prefix_tokens_reused_total": (
        "counter",
        "Prompt tokens not computed again because the stages kept their keys and values",
        (),
    ),
    "time_to_first_token_seconds": (
        "histogram",
        "From a generation request to its first new token",
        (),
    ),
    "time_per_output_token_seconds": (
        "histogram",
        "Time of each later generation step (a run of several decode steps: each its share)",
        (),
    ),
    "open_generation_sessions": ("gauge", "Generation sessions with caches on the stage", ()),
    "kv_cache_bytes": ("gauge", "Bytes of the generation caches on the stage", ()),
    "registered_stages": ("gauge", "Stages the coordinator knows (not yet forgotten)", ()),
    "gradient_store_keys": ("gauge", "Keys in the coordinator's gradient-group store", ()),
    "parked_collectives": (
        "gauge",
        "Gradient-sum collectives of failed runs the stage keeps until gloo ends them",
        (),
    ),
}
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """Records nothing; the interface every component records through."""

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Adds ``amount`` to a counter."""

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Records one value of a histogram."""

    def set(self, name: str, value: float, **labels: str) -> None:
        """Sets a gauge."""


NO_METRICS = Metrics()


class PrometheusMetrics(Metrics):
    """Metrics in a prometheus_client registry, with process metrics, served over HTTP."""

    def __init__(self) -> None:
        import prometheus_client as prom

        self._registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=self._registry)
        prom.PlatformCollector(registry=self._registry)
        self._metrics: dict[str, Any] = {}
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        for name, (kind, help_text, labels) in _DEFINITIONS.items():
            metric_name = f"pipesvc_{name}".removesuffix("_total")
            common: dict[str, Any] = {"labelnames": labels, "registry": self._registry}
            if kind == "counter":
                self._metrics[name] = prom.Counter(metric_name, help_text, **common)
            elif kind == "gauge":
                self._metrics[name] = prom.Gauge(metric_name, help_text, **common)
            else:
                self._metrics[name] = prom.Histogram(
                    metric_name, help_text, buckets=_BUCKETS, **common
                )

    def _get(self, name: str, labels: dict[str, str]) -> Any:
        # [Note: labelled children are cached] prometheus_client's ``labels()`` validates and
        # looks up the child under a lock on every call (tens of µs), and the data plane records
        # a few metrics per frame; the child for a name and labels never changes, so it is
        # looked up once. A racing first lookup just stores the same child twice.
        key = (name, tuple(labels.items()))
        child = self._children.get(key)
        if child is None:
            metric = self._metrics[name]
            child = metric.labels(**labels) if labels else metric
            self._children[key] = child
        return child

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        self._get(name, labels).inc(amount)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._get(name, labels).observe(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._get(name, labels).set(value)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serves ``/metrics`` in Prometheus text format; returns the bound port."""
        import prometheus_client as prom

        server, _ = prom.start_http_server(port, addr=host, registry=self._registry)
        return int(server.server_port)

    def text(self) -> str:
        """The current exposition text (for tests and debugging)."""
        import prometheus_client as prom

        return prom.generate_latest(self._registry).decode()
