"""The wire: gRPC transport, status mapping, interceptors, security, limits, and the payload
wire that carries a batch's tensors beside its requests."""
