"""Pure core: schedules, partitions, plans, micro-batches, losses, optimizers, config (no gRPC)."""
