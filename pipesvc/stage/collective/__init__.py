"""The gradient group of a rank's replicas (data parallel x pipeline): an all-reduce over gloo,
not gRPC."""
