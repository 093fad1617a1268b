"""A call's two Valkey round trips: before it goes upstream, its budget hold and its first attempt's pool
admission in one script (HOLD+ADMIT); after it, the budget settle, the pool settle and the progress hash in one
script (AFTER). Without Valkey (local caps), the same steps one after the other, in process.

HOLD+ADMIT  KEYS = [attempt, attempt:exp, run, run:exp, pacer, limits] (caps.py's four, then pacer.py's two)
            ARGV = HOLD's six, then ADMIT's five  ->  {which, admitted, wait_ms}
  A hold that does not fit: {which cap, 0, 0}, and nothing is booked with the pacer (a refused call takes no pool
  capacity). Else the hold is taken and ADMIT runs as alone: {0, 1, wait} booked (sleep `wait` once), or
  {0, 0, wait} when too far ahead to book (ValkeyPacer.admitted sleeps and asks ADMIT again).
AFTER  KEYS = [attempt, attempt:exp, run, run:exp, pacer, limits, progress]
       ARGV = [hold id ('' = none), actual micro-dollars, key TTL s, pool delta input, pool delta output,
               progress TTL s, then the progress hash's field/value pairs]

The run's keys ({run} hash tag) and the pool's ({pool}) are on one node: the deployed Valkey is a replication
group (one primary, cluster mode off).
"""

from __future__ import annotations

from typing import Any

from shim.caps import HOLD_FN, KEY_TTL_S, NOW_MS, SETTLE_FN, Budget, ValkeyBudget
from shim.pacer import ADMIT_FN, Pacer, PaceRequest, ValkeyPacer
from shim.pacer import SETTLE_FN as POOL_SETTLE_FN
from shim.progress import Progress

HOLD_ADMIT_LUA = NOW_MS + HOLD_FN + ADMIT_FN + """
local which = ep_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                      tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], math.floor(now))
if which ~= 0 then return {which, 0, 0} end
local a = ep_admit(KEYS[5], KEYS[6], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]),
                   tonumber(ARGV[11]), now)
return {0, a[1], a[2]}
"""

AFTER_LUA = NOW_MS + SETTLE_FN + POOL_SETTLE_FN + """
if ARGV[1] ~= '' then ep_settle(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), ARGV[3]) end
local d_in, d_out = tonumber(ARGV[4]), tonumber(ARGV[5])
if d_in ~= 0 or d_out ~= 0 then ep_settle_pool(KEYS[5], KEYS[6], d_in, d_out, 0, now) end
if #ARGV > 6 then
  redis.call('HSET', KEYS[7], unpack(ARGV, 7))
  redis.call('EXPIRE', KEYS[7], ARGV[6])
end
return 1
"""


class Gate:
    def __init__(self, budget: Budget, pacer: Pacer, progress: Progress, redis=None):
        self.budget, self.pacer, self.progress = budget, pacer, progress
        self.combined = redis is not None and isinstance(budget, ValkeyBudget) and isinstance(pacer, ValkeyPacer)
        if self.combined:
            self.keys = [*budget.keys, *pacer.keys]
            self._hold_admit = redis.register_script(HOLD_ADMIT_LUA)
            self._after = redis.register_script(AFTER_LUA)

    async def hold(self, call_id: str, est_micro: int, pace: PaceRequest, deadline: float | None = None) -> tuple[int, float]:
        """Hold the call's worst case, then admit its first attempt with the pool: (0, ms waited for the
        pool), or (the cap that refused it, 0). PastDeadline if the pool's wait would pass `deadline`."""
        if not self.combined:
            which = await self.budget.hold(call_id, est_micro)
            return (which, 0.0) if which else (0, await self.pacer.admit(pace, deadline))
        which, ok, wait_ms = await self._hold_admit(
            keys=self.keys, args=[*self.budget.hold_args(call_id, est_micro), *self.pacer.admit_args(pace)])
        if which:
            return int(which), 0.0
        return 0, await self.pacer.admitted(pace, int(ok) == 1, float(wait_ms), deadline)

    async def after(self, hold_id: str | None, actual_micro: int, pace: PaceRequest | None,
                    used_in: int | None, used_out: int | None, progress: dict[str, Any]) -> None:
        """Settle a call: its hold to its actual cost, its last attempt's pool booking to what it used; publish
        progress."""
        if not self.combined:
            if pace is not None:
                await self.pacer.settle(pace, used_in, used_out)
            if hold_id is not None:
                await self.budget.settle(hold_id, actual_micro)
            return await self.progress.publish(progress)
        deltas = [0, 0] if pace is None else ValkeyPacer.settle_args(pace, used_in, used_out)
        key, ttl, flat = self.progress.update(progress)
        await self._after(keys=[*self.keys, key],
                          args=[hold_id or "", actual_micro, KEY_TTL_S, *deltas, ttl, *flat])
