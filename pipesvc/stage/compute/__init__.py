"""What a stage computes: the step engine and runtime, generation caches, its profile and
recorded timeline, and fault injection for tests. Never reaches gRPC."""
