"""gRPC definitions of kvkeep; `proto/gen/` is generated (run `make proto`, never edit it)."""
