"""The wire: gRPC transport, status mapping, interceptors, security, limits and the tensor codec."""
