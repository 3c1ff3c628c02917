"""Observability: metrics, logs and step traces."""
