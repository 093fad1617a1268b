"""Dollar caps as holds: a call's worst-case cost is reserved against the attempt's and the run's caps
atomically before it goes upstream, and settled to the actual cost after. Amounts are integer micro-dollars.

Valkey layout (all keys share the run's hash tag, so one script touches one shard):
  contract.keys.attempt_budget(ref) / run_budget(run): hash {spent, held, cap, hold:<call_id> -> amount}
  <same key>:exp: zset call_id -> hold deadline (ms); expired holds are swept by the next hold that needs room.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

from contract import keys

KEY_TTL_S = 14 * 24 * 3600
ATTEMPT_CAP, RUN_CAP = 1, 2

# ep_hold(...) -> 0 if held, else which cap refused it (1 attempt, 2 run); `now` in integer ms.
# The hashes get their TTL when created here and have it refreshed by every settle.
HOLD_FN = """
local function ep_hold(ka, kae, kr, kre, id, est, acap, rcap, ttl_ms, key_ttl, now)
  -- held already: the shim asking again after an answer it did not get (a store that timed out)
  if redis.call('HEXISTS', ka, 'hold:' .. id) == 1 then return 0 end
  local function sweep(h, z)
    for _, eid in ipairs(redis.call('ZRANGEBYSCORE', z, '-inf', now)) do
      local amt = redis.call('HGET', h, 'hold:' .. eid)
      if amt then
        redis.call('HINCRBY', h, 'held', -tonumber(amt))
        redis.call('HDEL', h, 'hold:' .. eid)
      end
      redis.call('ZREM', z, eid)
    end
  end
  local function fits(x, cap)
    return cap < 0 or tonumber(x[1] or '0') + tonumber(x[2] or '0') + est <= cap
  end
  local a = redis.call('HMGET', ka, 'spent', 'held', 'cap')
  local r = redis.call('HMGET', kr, 'spent', 'held', 'cap')
  if not (fits(a, acap) and fits(r, rcap)) then
    sweep(ka, kae)
    sweep(kr, kre)
    a = redis.call('HMGET', ka, 'spent', 'held', 'cap')
    r = redis.call('HMGET', kr, 'spent', 'held', 'cap')
    if not fits(a, acap) then return 1 end
    if not fits(r, rcap) then return 2 end
  end
  local hs, zs, xs, caps = {ka, kr}, {kae, kre}, {a, r}, {acap, rcap}
  for i = 1, 2 do
    local x = xs[i]
    redis.call('HINCRBY', hs[i], 'held', est)
    redis.call('HSET', hs[i], 'hold:' .. id, est)
    if caps[i] >= 0 and tonumber(x[3] or '-1') ~= caps[i] then redis.call('HSET', hs[i], 'cap', caps[i]) end
    if not x[1] and not x[2] and not x[3] then redis.call('EXPIRE', hs[i], key_ttl) end
    redis.call('ZADD', zs[i], now + ttl_ms, id)
    redis.call('EXPIRE', zs[i], key_ttl)
  end
  return 0
end
"""

# ep_settle(...): the hold `id` released and `actual` charged, on the attempt and on the run; TTLs refreshed.
SETTLE_FN = """
local function ep_settle(ka, kae, kr, kre, id, actual, key_ttl)
  local hs, zs = {ka, kr}, {kae, kre}
  for i = 1, 2 do
    local amt = redis.call('HGET', hs[i], 'hold:' .. id)
    if amt then
      redis.call('HINCRBY', hs[i], 'held', -tonumber(amt))
      redis.call('HDEL', hs[i], 'hold:' .. id)
    end
    redis.call('ZREM', zs[i], id)
    redis.call('HINCRBY', hs[i], 'spent', actual)
    redis.call('EXPIRE', hs[i], key_ttl)
  end
end
"""

NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
"""

# KEYS = [attempt, attempt:exp, run, run:exp]; ARGV = [call_id, est, acap, rcap, ttl_ms, key_ttl_s]
HOLD_LUA = NOW_MS + HOLD_FN + """
return ep_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
               tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], math.floor(now))
"""
# KEYS as HOLD's; ARGV = [call_id, actual, key_ttl_s]
SETTLE_LUA = SETTLE_FN + """
ep_settle(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), ARGV[3])
return 1
"""


def micro(usd: float) -> int:
    """USD -> integer micro-dollars, rounded up (what we hold or charge is never below the truth)."""
    return math.ceil(round(usd * 1_000_000, 6))


def cap_micro(usd: float | None) -> int:
    return -1 if usd is None else math.floor(round(usd * 1_000_000, 6))


class Budget(Protocol):
    async def hold(self, call_id: str, est_micro: int) -> int:
        """0 if held, else which cap refused it (ATTEMPT_CAP or RUN_CAP)."""

    async def settle(self, call_id: str, actual_micro: int) -> None: ...


class ValkeyBudget:
    def __init__(self, redis, ref, attempt_cap_usd: float | None, run_cap_usd: float | None, hold_ttl_s: float):
        a, r = keys.attempt_budget(ref), keys.run_budget(ref.run)
        self.keys = [a, a + ":exp", r, r + ":exp"]
        self.acap, self.rcap = cap_micro(attempt_cap_usd), cap_micro(run_cap_usd)
        self.ttl_ms = int(hold_ttl_s * 1000)
        self._hold = redis.register_script(HOLD_LUA)
        self._settle = redis.register_script(SETTLE_LUA)

    def hold_args(self, call_id: str, est_micro: int) -> list:
        """HOLD's ARGV (also the first six of the HOLD+ADMIT script's: shim/admission.py)."""
        return [call_id, est_micro, self.acap, self.rcap, self.ttl_ms, KEY_TTL_S]

    async def hold(self, call_id: str, est_micro: int) -> int:
        return int(await self._hold(keys=self.keys, args=self.hold_args(call_id, est_micro)))

    async def settle(self, call_id: str, actual_micro: int) -> None:
        await self._settle(keys=self.keys, args=[call_id, actual_micro, KEY_TTL_S])


class LocalBudget:
    """The same rules in process (no Valkey configured): the run cap then only covers this attempt."""

    def __init__(self, attempt_cap_usd: float | None, run_cap_usd: float | None, hold_ttl_s: float):
        self.acap, self.rcap = cap_micro(attempt_cap_usd), cap_micro(run_cap_usd)
        self.ttl_s = hold_ttl_s
        self.spent = 0
        self.holds: dict[str, tuple[int, float]] = {}

    async def hold(self, call_id: str, est_micro: int) -> int:
        now = time.monotonic()
        self.holds = {k: v for k, v in self.holds.items() if v[1] > now}
        total = self.spent + sum(v[0] for v in self.holds.values()) + est_micro
        if self.acap >= 0 and total > self.acap:
            return ATTEMPT_CAP
        if self.rcap >= 0 and total > self.rcap:
            return RUN_CAP
        self.holds[call_id] = (est_micro, now + self.ttl_s)
        return 0

    async def settle(self, call_id: str, actual_micro: int) -> None:
        self.holds.pop(call_id, None)
        self.spent += actual_micro
