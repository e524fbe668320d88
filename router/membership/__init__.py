"""The workers: what each registers and reports (`workers`), the watch that applies etcd's
view (`registry`), their vLLM metrics (`scraper`), which addresses may be used (`allowlist`),
and the rebinding of a dead worker's sessions (`failover`)."""
