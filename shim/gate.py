"""The one Valkey round trip before a call is forwarded: the budget hold and the pacer admission of its first
upstream attempt, in one Lua script (both still atomic, and together).

HOLD+ADMIT  KEYS = [attempt, attempt:exp, run, run:exp, pacer, limits] (caps.py's four, then pacer.py's two)
            ARGV = HOLD's six, then ADMIT's five
  -> {held, which, admitted, wait_ms}
  If the hold does not fit: {0, which cap, 0, 0}, and nothing is booked with the pacer (a refused call takes
  no pool capacity). Else the hold is taken and ADMIT runs as alone: {1, 0, 1, wait} booked (sleep `wait`
  once), or {1, 0, 0, wait} when too far ahead to book (ValkeyPacer.admitted sleeps and asks ADMIT again).

The run's keys ({run} hash tag) and the pool's ({pool}) are on one node: the deployed Valkey is a replication
group (one primary, cluster mode off). A cluster would need the two scripts pipelined instead.

Without a Valkey budget and pacer (local caps, or a pacer injected by a test), the hold and the admission are
made one after the other, as before.
"""

from __future__ import annotations

from shim.caps import HOLD_FN, Budget, ValkeyBudget
from shim.kv import Script
from shim.pacer import ADMIT_FN, Pacer, PaceRequest, ValkeyPacer

HOLD_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
""" + HOLD_FN + ADMIT_FN + """
local which = ep_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                      tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], math.floor(now))
if which ~= 0 then return {0, which, 0, 0} end
local a = ep_admit(KEYS[5], KEYS[6], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]),
                   tonumber(ARGV[11]), now)
return {1, 0, a[1], a[2]}
"""
HOLD_ADMIT_SCRIPT = Script(HOLD_ADMIT_LUA)


class Gate:
    def __init__(self, budget: Budget, pacer: Pacer):
        self.budget = budget
        self.pacer = pacer
        self.combined = (isinstance(budget, ValkeyBudget) and isinstance(pacer, ValkeyPacer)
                         and budget.kv is pacer.kv)
        if self.combined:
            self.kv = budget.kv
            self.script = self.kv.register(HOLD_ADMIT_SCRIPT)
            self.keys = [*budget.keys, *pacer.keys]

    async def hold(self, call_id: str, est_micro: int, pace: PaceRequest) -> tuple[int, bool, float, bool]:
        """Hold the call's worst case, then admit its first attempt.

        Returns (which, ok, wait_ms, answered): which = 0 if held, else the cap that refused it (then nothing
        else happened). When held and `answered`, (ok, wait_ms) is the ADMIT answer to act on with
        ValkeyPacer.admitted; when not `answered`, the caller admits the attempt itself (pacer.admit)."""
        if not self.combined:
            return await self.budget.hold(call_id, est_micro), False, 0.0, False
        held, which, ok, wait_ms = await self.kv.script(
            self.script, self.keys, [*self.budget.hold_args(call_id, est_micro), *self.pacer.admit_args(pace)])
        if int(held) != 1:
            return int(which), False, 0.0, False
        return 0, int(ok) == 1, float(wait_ms), True
