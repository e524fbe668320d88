"""The control plane every kvkeep component shares: one retry policy (`retry`), one supervisor
for long-lived tasks (`supervisor`), total decoders for what etcd holds (`records`), one prefix
watcher (`watcher`: list, watch, resync, grace, a typed decoder and a trust check), one lease
keeper (`lease`: a key under a lease, verified and rewritten when tampered with) and one
token-file reader (`tokens`).

Daemon registration and discovery (kvstore/daemon/registration.py, kvstore/tiers/discovery.py)
and the router's worker agent and worker and binding watches (router/agent.py,
router/state/etcd.py) are built on these, so a fix to membership lands once.

Submodules are imported by name (`from kvstore.cluster.watcher import PrefixWatcher`): this
package module imports none of them, so reading one never loads aetcd.
"""
