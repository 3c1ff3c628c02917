"""Generated wire code for protos/pipesvc/v1 (do not edit; run ``python -m pipesvc.wire.proto_build``)."""
