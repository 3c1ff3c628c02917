"""Planning, pure: how layers are split (partition), what a split costs on measured stages
(throughput), and which stages hold which layers (placement). No I/O: the coordinator's planner
and re-planner measure, call this, and apply what it decides."""
