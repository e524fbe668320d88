"""The control plane every kvkeep component shares: one retry policy (`retry`), one supervisor
for long-lived tasks (`supervisor`), total decoders for what etcd holds (`records`), one prefix
watcher (`watcher`: list, watch, resync, grace, a typed decoder and a trust check), one lease
keeper (`lease`: a key under a lease, verified and rewritten when tampered with) and one
token-file reader (`tokens`). The daemons' membership lives here too: what a daemon registers
(`daemon_info`), what proves it (`daemon_trust`: Ed25519-signed registrations, mTLS, loopback)
and the live view of them (`discovery`); kvstore/tiers/ keeps their old names as re-exports.

Daemon registration (kvstore/daemon/registration.py), daemon discovery and the router's worker
agent and worker and binding watches (router/node/agent.py, router/state/etcd.py) are built on
these, so a fix to membership lands once.

Submodules are imported by name (`from kvstore.cluster.watcher import PrefixWatcher`): this
package module imports none of them, so reading one never loads aetcd.
"""
