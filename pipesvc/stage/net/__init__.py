"""A stage's gRPC streams to other stages: the activation and gradient links, the tied-weight
link and the link probe."""
