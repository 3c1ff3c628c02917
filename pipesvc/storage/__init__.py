"""Storage: weight files and checkpoints (no gRPC)."""
