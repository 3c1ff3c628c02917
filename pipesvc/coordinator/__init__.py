"""Coordinator server: registry, job driver and servicer."""
