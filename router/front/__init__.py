"""A request's path through the router: the OpenAI-compatible HTTP front (`proxy`), the
request parsed (`api`) and admitted (`admission`, `kv_params`), its whole life owned by the
`director`, sent to the workers and classified (`dispatch`, `upstream`)."""
