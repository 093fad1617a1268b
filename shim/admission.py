"""A call's two Valkey round trips: before it goes upstream, its budget hold and its first attempt's pool
admission in one script (HOLD+ADMIT); after it, the budget settle, the pool settle and the progress hash in one
script (AFTER). Without Valkey (local caps), the same steps one after the other, in process.

HOLD+ADMIT  KEYS = [attempt, attempt:exp, run, run:exp, pacer, limits] (caps.py's four, then pacer.py's two)
            ARGV = HOLD's six, then ADMIT's five  ->  {which, admitted, wait_ms}
  A hold that does not fit: {which cap, 0, 0}, and nothing is booked with the pacer (a refused call takes no pool
  capacity). Else the hold is taken and ADMIT runs as alone: {0, 1, wait} booked (sleep `wait` once), or
  {0, 0, wait} when too far ahead to book (ValkeyPacer.admitted sleeps and asks ADMIT again).
AFTER  KEYS = [attempt, attempt:exp, run, run:exp, pacer, limits, progress]
       ARGV = [key TTL s, progress TTL s, the progress hash as a JSON object, then four per call settled:
               hold id ('' = none), actual micro-dollars, pool delta input, pool delta output]

The run's keys ({run} hash tag) and the pool's ({pool}) are on one node: the deployed Valkey is a replication
group (one primary, cluster mode off).
"""

from __future__ import annotations

from typing import Any

from contract import keys
from shim.caps import HOLD_FN, KEY_TTL_S, NOW_MS, SETTLE_FN, Budget, ValkeyBudget
from shim.pacer import ADMIT_FN, Pacer, PaceRequest, ValkeyPacer
from shim.pacer import SETTLE_FN as POOL_SETTLE_FN
from shim.progress import SessionProgress
from shim.wire import dumps

HOLD_ADMIT_LUA = NOW_MS + HOLD_FN + ADMIT_FN + """
local which = ep_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                      tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], math.floor(now))
if which ~= 0 then return {which, 0, 0} end
local a = ep_admit(KEYS[5], KEYS[6], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]),
                   tonumber(ARGV[11]), now)
return {0, a[1], a[2]}
"""

AFTER_LUA = NOW_MS + SETTLE_FN + POOL_SETTLE_FN + """
for i = 4, #ARGV, 4 do
  if ARGV[i] ~= '' then ep_settle(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[i], tonumber(ARGV[i + 1]), ARGV[1]) end
  local d_in, d_out = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  if d_in ~= 0 or d_out ~= 0 then ep_settle_pool(KEYS[5], KEYS[6], d_in, d_out, 0, now) end
end
local flat = {}
for k, v in pairs(cjson.decode(ARGV[3])) do
  flat[#flat + 1] = k
  flat[#flat + 1] = v
end
redis.call('HSET', KEYS[7], unpack(flat))
redis.call('EXPIRE', KEYS[7], ARGV[2])
return 1
"""

# one call's settle: (hold id or None, actual micro-dollars, its last attempt's pool booking or None, what that
# attempt used toward the pool's input and output limits: None = unknown)
Settle = tuple[str | None, int, PaceRequest | None, int | None, int | None]


class Gate:
    def __init__(self, budget: Budget, pacer: Pacer, progress: SessionProgress, redis=None):
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

    async def after(self, settles: list[Settle], progress: dict[str, Any]) -> None:
        """Settle calls (each hold to its actual cost, each last attempt's pool booking to what it used) and
        publish progress: in one script with Valkey."""
        if not self.combined:
            for hold_id, actual, pace, used_in, used_out in settles:
                if pace is not None:
                    await self.pacer.settle(pace, used_in, used_out)
                if hold_id is not None:
                    await self.budget.settle(hold_id, actual)
            return await self.progress.publish(progress)
        args: list[Any] = [KEY_TTL_S, keys.PROGRESS_TTL_S, dumps(progress)]
        for hold_id, actual, pace, used_in, used_out in settles:
            args += [hold_id or "", actual, *([0, 0] if pace is None else ValkeyPacer.settle_args(pace, used_in, used_out))]
        await self._after(keys=[*self.keys, self.progress.key], args=args)
