"""The wire between kvstore daemons and their clients: what both ends share, and the client side.

- `limits`: the sizes both ends agree on; `scope`: what one request's keys share.
- `refusal`: why a daemon refuses a call (one reason enum, numbered as gRPC status codes) and
  `client_error`, the one table that turns a status from either transport into an exception.
- `grpc_options`: channel and server options, keepalive for both ends from one policy;
  `grpc_messages`: the zero-copy codec of the bulk messages, conversions of the small ones.
- `tcp_protocol`: the TCP data plane's framing and socket helpers.
- `transport`: the `BlockTransport` protocol (block GET/PUT to one daemon), implemented by
  `grpc_transport` and `tcp_transport`.
- `daemon_client`: `DaemonClient`, one daemon: control calls over gRPC, blocks over the
  transport chosen for it once.

The daemon's halves (one transport-neutral core, a gRPC front and a TCP front) are in
kvstore/daemon/, which imports this package and is never imported by it.
"""
