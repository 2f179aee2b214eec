"""Prometheus metrics of saves, restores and backups (the ``[metrics]`` extra).

:class:`PrometheusExporter` subscribes to :func:`ckptcore.on_event` and turns every event into
Prometheus series; :func:`start_exporter` also serves them over HTTP for a scraper.
``prometheus_client`` is imported when an exporter is made, never by ``import ckptcore``
(``pip install 'ckptcore[metrics]'``).

The series (``kind`` is ``save``, ``restore`` or ``backup``):

========================================  =========  ==============================================
name                                      type       what
========================================  =========  ==============================================
``ckptcore_operations_total``             counter    operations, by ``kind`` and ``outcome``
                                                     (``ok`` or the error's type name)
``ckptcore_seconds``                      histogram  seconds until committed (restored, replicated)
``ckptcore_blocked_seconds``              histogram  seconds the caller waited
``ckptcore_bytes_total``                  counter    logical bytes of the checkpoints
``ckptcore_written_bytes_total``           counter    bytes written
``ckptcore_deduplicated_bytes_total``     counter    bytes a backup found in its blobs already
``ckptcore_requests_total``               counter    storage requests
``ckptcore_fallbacks_total``              counter    restore candidates passed over, by ``reason``
``ckptcore_takeovers_total``              counter    writer locks taken over
``ckptcore_last_step``                    gauge      the step of the last successful operation
``ckptcore_replication_lag_steps``        gauge      steps a backup lacks, by ``backup`` (its URL)
``ckptcore_replication_lag_seconds``      gauge      seconds since the oldest of them was handed
========================================  =========  ==============================================

Example:
    >>> exporter = ckptcore.metrics.start_exporter(port=9109)  # doctest: +SKIP
    >>> # ... train; Prometheus scrapes http://<host>:9109/metrics ...
    >>> exporter.close()                                        # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from . import events

__all__ = ["PrometheusExporter", "start_exporter"]

_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _client() -> Any:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as e:
        raise ImportError("ckptcore.metrics needs prometheus_client: pip install "
                          "'ckptcore[metrics]' (or prometheus_client)") from e


class PrometheusExporter:
    """The series of the module docstring in ``registry`` (a fresh
    ``prometheus_client.CollectorRegistry`` when None; pass ``prometheus_client.REGISTRY`` to
    join the process's default one), fed by every event until :meth:`close`.

    Args:
        registry: Where the series are registered.
        namespace: The prefix of every series' name.
    """

    def __init__(self, registry: Any = None, *, namespace: str = "ckptcore") -> None:
        pc = _client()
        self.registry = pc.CollectorRegistry() if registry is None else registry
        self._server: Any = None
        self._thread: Any = None
        self.port: int | None = None
        r, ns = self.registry, namespace
        self._ops = pc.Counter(f"{ns}_operations", "Saves, restores and backup replications",
                               ["kind", "outcome"], registry=r)
        self._seconds = pc.Histogram(f"{ns}_seconds", "Seconds until committed, restored or "
                                     "replicated", ["kind"], buckets=_BUCKETS, registry=r)
        self._blocked = pc.Histogram(f"{ns}_blocked_seconds", "Seconds the caller waited",
                                     ["kind"], buckets=_BUCKETS, registry=r)
        self._bytes = pc.Counter(f"{ns}_bytes", "Logical bytes of the checkpoints", ["kind"],
                                 registry=r)
        self._written = pc.Counter(f"{ns}_written_bytes", "Bytes written", ["kind"], registry=r)
        self._dedup = pc.Counter(f"{ns}_deduplicated_bytes", "Bytes a backup already held",
                                 ["kind"], registry=r)
        self._requests = pc.Counter(f"{ns}_requests", "Storage requests", ["kind"], registry=r)
        self._fallbacks = pc.Counter(f"{ns}_fallbacks", "Restore candidates passed over",
                                     ["reason"], registry=r)
        self._takeovers = pc.Counter(f"{ns}_takeovers", "Writer locks taken over", registry=r)
        self._step = pc.Gauge(f"{ns}_last_step", "Step of the last successful operation",
                              ["kind"], registry=r)
        self._lag_steps = pc.Gauge(f"{ns}_replication_lag_steps", "Steps a backup tier lacks",
                                   ["backup"], registry=r)
        self._lag_seconds = pc.Gauge(f"{ns}_replication_lag_seconds", "Seconds since the oldest "
                                     "step a backup tier lacks was handed to it", ["backup"],
                                     registry=r)
        self._collectors = [self._ops, self._seconds, self._blocked, self._bytes, self._written,
                            self._dedup, self._requests, self._fallbacks, self._takeovers,
                            self._step, self._lag_steps, self._lag_seconds]
        self._subscription = events.on_event(self.observe)

    def observe(self, event: events.Event) -> None:
        """Count one event (what the subscription calls)."""
        kind = event.kind
        self._ops.labels(kind, event.error or "ok").inc()
        self._seconds.labels(kind).observe(event.seconds_total)
        self._blocked.labels(kind).observe(event.seconds_blocked)
        self._bytes.labels(kind).inc(event.bytes)
        self._written.labels(kind).inc(event.bytes_written)
        self._dedup.labels(kind).inc(event.bytes_deduplicated)
        self._requests.labels(kind).inc(event.requests)
        for fallback in event.fallbacks:
            self._fallbacks.labels(fallback.reason).inc()
        if event.takeovers:
            self._takeovers.inc(len(event.takeovers))
        if event.error is None and event.step is not None:
            self._step.labels(kind).set(event.step)
        for lag in event.replication_lag:
            self._lag_steps.labels(lag.url).set(lag.steps)
            self._lag_seconds.labels(lag.url).set(lag.seconds)

    def serve(self, port: int = 9109, addr: str = "127.0.0.1") -> int:
        """Serve the registry at ``http://addr:port/metrics`` in a daemon thread (``port=0``:
        any free port); returns the port.  ``addr="0.0.0.0"`` lets other hosts scrape it."""
        if self._server is not None:
            raise ValueError(f"this exporter serves on port {self.port} already")
        self._server, self._thread = _client().start_http_server(port, addr=addr,
                                                                 registry=self.registry)
        self.port = int(self._server.server_address[1])
        return self.port

    def close(self) -> None:
        """Stop counting events and serving, and unregister the series."""
        self._subscription.remove()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None
        for c in self._collectors:
            try:
                self.registry.unregister(c)
            except KeyError:  # unregistered already (close() twice)
                pass

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_exporter(port: int = 9109, *, addr: str = "127.0.0.1", registry: Any = None,
                   namespace: str = "ckptcore") -> PrometheusExporter:
    """A :class:`PrometheusExporter` serving ``http://addr:port/metrics`` (``port=0``: a free
    one, then in ``exporter.port``); ``exporter.close()`` stops it.  Listens on the loopback
    interface unless ``addr`` says otherwise (``"0.0.0.0"``: every interface)."""
    exporter = PrometheusExporter(registry, namespace=namespace)
    try:
        exporter.serve(port, addr)
    except BaseException:
        exporter.close()
        raise
    return exporter
