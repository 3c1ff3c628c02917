"""How a stage's tensors arrive and leave in memory: mailboxes, frames, the send and read sides
of a link, shared memory and its slots, and malloc settings. Never reaches gRPC."""
