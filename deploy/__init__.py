"""kvkeep deployment: a real local cluster (`deploy.local`), the failover demo (`kvkeep demo`),
chaos runs (`kvkeep chaos`) and Kubernetes manifests (`deploy/k8s/`).

Nothing here is imported by the serving components: `kvkeep store`, `router` and the connector
never depend on it. Heavy imports (torch, transformers, openai) happen inside the commands.
"""
