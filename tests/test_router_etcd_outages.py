"""The router's binding writes when etcd is away or has lost a lease (trust review M9), with a
real etcd: a revoked bucket lease is replaced at once instead of failing every write until the
bucket rolls over, and while etcd does not answer, binding writes fail at once after the first
(the session is not recorded, as on any failure) instead of each costing the etcd timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aetcd  # type: ignore[import-untyped]
import pytest

from deploy.local.processes import freeze
from deploy.local.services import EtcdServer
from kvstore.keys import SessionId
from router.errors import StateUnavailable
from router.membership.workers import WorkerId
from router.state import EtcdBackend
from router.state.bindings import Binding


def test_a_revoked_bucket_lease_is_replaced_not_failed_on(etcd_server: EtcdServer) -> None:
    async def run() -> None:
        backend = EtcdBackend(etcd_server.url, "/m9a")
        await backend.start()
        admin = aetcd.Client(host="127.0.0.1", port=etcd_server.port)
        try:
            ok, _ = await backend.cas_binding(Binding(SessionId("s1"), WorkerId("w1"), "m"),
                                              None, 600)
            assert ok
            meta = await admin.get(b"/m9a/sessions/s1")
            assert meta is not None and meta.lease  # written under the bucket lease
            await admin.revoke_lease(meta.lease)  # an operator's revoke, a snapshot restore
            assert await backend.get_binding(SessionId("s1")) is None  # went with its lease
            ok, vb = await backend.cas_binding(Binding(SessionId("s2"), WorkerId("w1"), "m"),
                                               None, 600)
            assert ok and vb is not None
            assert await backend.get_binding(SessionId("s2")) == vb
            meta2 = await admin.get(b"/m9a/sessions/s2")
            assert meta2 is not None and meta2.lease and meta2.lease != meta.lease
        finally:
            await admin.close()
            await backend.close()
    asyncio.run(run())


@pytest.mark.timeout(120)
def test_binding_writes_fail_fast_while_etcd_does_not_answer(etcd_server: EtcdServer) -> None:
    async def run() -> None:
        backend = EtcdBackend(etcd_server.url, "/m9b", timeout_s=1.0, binding_breaker_s=1.5)
        await backend.start()
        try:
            ok, _ = await backend.cas_binding(Binding(SessionId("s0"), WorkerId("w1"), "m"),
                                              None, 600)
            assert ok
            freeze(etcd_server.proc.pid)
            try:
                with pytest.raises(StateUnavailable, match="CAS failed"):
                    await backend.cas_binding(Binding(SessionId("s1"), WorkerId("w1"), "m"),
                                              None, 600)
                # The next write does not wait for etcd again: it is refused on the spot.
                with pytest.raises(StateUnavailable, match="skipped"):
                    await backend.cas_binding(Binding(SessionId("s2"), WorkerId("w1"), "m"),
                                              None, 600)
            finally:
                os.kill(etcd_server.proc.pid, signal.SIGCONT)
            # Once etcd answers again and the window has passed, writes go through.
            for _ in range(100):
                try:
                    ok, vb = await backend.cas_binding(
                        Binding(SessionId("s3"), WorkerId("w1"), "m"), None, 600)
                    break
                except StateUnavailable:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("binding writes never came back after etcd did")
            assert ok and await backend.get_binding(SessionId("s3")) == vb
        finally:
            await backend.close()
    asyncio.run(run())
