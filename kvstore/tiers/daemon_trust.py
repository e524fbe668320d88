"""Moved to the control plane: kvstore/cluster/daemon_trust.py (this name stays for importers)."""

from kvstore.cluster.daemon_trust import (
    DaemonTrust,
    RegistrationSigner,
    identities,
    load_verify_keys,
    signed_message,
)

__all__ = ["DaemonTrust", "RegistrationSigner", "identities", "load_verify_keys",
           "signed_message"]
