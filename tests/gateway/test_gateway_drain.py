"""The meter's drain (gateway/runtime.py): rows move from Valkey to PostgreSQL under a short lease, and a drain that
lost its lease mid-way trims nothing, so a replica killed or stalled while draining loses no row; a run closes once
its rows have landed (gateway/runs.py)."""

from __future__ import annotations

import asyncio
import json

from gateway import runs
from gateway.config import GatewaySettings
from gateway.runtime import ROW_FIELDS, Runtime, database_place, meter_keys


def _row(owner: str, i: int) -> dict:
    row = dict.fromkeys(ROW_FIELDS, 0) | {
        "gateway_call_id": f"{owner}-{i}", "owner": owner, "alias": "a", "deployment": "d", "route": "acompletion",
        "started_at": "2026-12-06T00:00:00+00:00", "status": "ok", "replica": "replica-0"}
    return row


def test_a_drain_that_lost_its_lease_leaves_the_rows_for_the_next(database_url, valkey_url, pg, unique, tmp_path):
    async def go() -> tuple[int, int, int, int]:
        rt = Runtime(GatewaySettings(database_url=database_url, valkey_url=valkey_url,
                                     provider_keys_file=tmp_path / "keys.json"))
        rt.rows_key, rt.lock_key = f"test:{unique}:rows", f"test:{unique}:lock"  # not the live tier's
        for i in range(3):
            await rt.valkey.rpush(rt.rows_key, json.dumps(_row(unique, i)))
        insert = rt._query

        async def stalled(fn):  # the lease runs out during the INSERT and another replica's drain takes the lock
            await rt.valkey.set(rt.lock_key, "another replica", px=300)
            return await insert(fn)

        rt._query = stalled
        lost = await rt.drain()
        left = await rt.valkey.llen(rt.rows_key)
        rt._query = insert
        await asyncio.sleep(0.4)
        moved = await rt.drain()
        remaining = await rt.valkey.llen(rt.rows_key)
        await rt.valkey.aclose()
        return lost, left, moved, remaining

    lost, left, moved, remaining = asyncio.run(go())
    assert (lost, left) == (0, 3)  # nothing trimmed by the drain whose lease ran out
    assert (moved, remaining) == (3, 0)
    count = pg.execute("SELECT count(*) FROM gateway_calls WHERE owner = %s", (unique,)).fetchone()[0]
    assert count == 3  # the first drain's INSERT and the second's land each row once


def test_a_run_closes_once_its_meter_rows_have_landed(database_url, valkey_url, pg, valkey, unique, tmp_path):
    """close_run waits for the run's rows still in Valkey: not drained while the drain lock is held elsewhere, then
    landed once a drain runs (the dispatcher and the replicas name the same list whatever user each logs in as)."""
    rows_key, lock_key = meter_keys(pg.info.host, pg.info.port, pg.info.dbname)
    assert (rows_key, lock_key) == meter_keys(*database_place(database_url))
    valkey.set(lock_key, "a replica draining elsewhere", px=20_000)  # no drain moves rows meanwhile
    try:
        valkey.rpush(rows_key, json.dumps(_row(unique, 0)))
        assert runs.meter_drained(pg, valkey, unique, timeout_s=0.5) is False
        assert runs.meter_drained(pg, valkey, "another-run", timeout_s=0.5) is True  # not waiting on others' rows
    finally:
        valkey.delete(lock_key)

    async def drain() -> int:
        rt = Runtime(GatewaySettings(database_url=database_url, valkey_url=valkey_url,
                                     provider_keys_file=tmp_path / "keys.json"))
        try:
            return await rt.drain()
        finally:
            await rt.valkey.aclose()

    asyncio.run(drain())  # the session's gateway replicas, where they run, may drain it first
    assert runs.meter_drained(pg, valkey, unique, timeout_s=10) is True
    count = pg.execute("SELECT count(*) FROM gateway_calls WHERE owner = %s", (unique,)).fetchone()[0]
    assert count == 1
