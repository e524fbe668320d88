"""The router as an Envoy `ext_proc` endpoint picker (the Gateway API Inference Extension's
EPP protocol): `server.py` serves it, `stream.py` runs one request's phases, `picker.py`
decides with the router core, `endpoints.py` names workers as `ip:port`. Importing it needs
the `gateway` extra (`xds-protos`)."""
