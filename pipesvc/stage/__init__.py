"""Stage server: compute, data plane and servicer."""
