"""Dollar caps as holds: reserve a call's worst-case cost against the attempt and run caps atomically
before it goes upstream, settle to the actual cost after. Amounts are integer micro-dollars.

Valkey layout (all keys share the run's hash tag, so one script touches one shard):
  contract.keys.attempt_budget(ref) / run_budget(run): hash {spent, held, cap, hold:<call_id> -> amount}
  <same key>:exp: zset call_id -> hold deadline (ms); expired holds are swept by the next hold.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

from contract import keys
from shim.kv import Script, as_kv

KEY_TTL_S = 14 * 24 * 3600

# ep_hold(...) -> 0 if held, else which cap refused it (1 attempt, 2 run); `now` in integer ms; `rroom` (or nil):
# the run's total (spent + held) this hold must stay within, below the cap (a ticket: shim/gate.py).
# KEYS of the caller: attempt hash, its :exp zset, run hash, its :exp zset.
# Expired holds (calls that never settled) are swept only when they could matter: before a hold is refused.
# The hashes get their TTL when created here and have it refreshed by every settle (off the call's path).
HOLD_FN = """
local function ep_hold(ka, kae, kr, kre, id, est, acap, rcap, ttl_ms, key_ttl, now, rroom)
  local function sweep(h, z)
    local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
    for _, eid in ipairs(expired) do
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
  local rlim = rcap
  if rroom and rcap >= 0 and rroom < rcap then rlim = rroom end
  local a = redis.call('HMGET', ka, 'spent', 'held', 'cap')
  local r = redis.call('HMGET', kr, 'spent', 'held', 'cap')
  if not (fits(a, acap) and fits(r, rlim)) then
    sweep(ka, kae)
    sweep(kr, kre)
    a = redis.call('HMGET', ka, 'spent', 'held', 'cap')
    r = redis.call('HMGET', kr, 'spent', 'held', 'cap')
    if not fits(a, acap) then return 1 end
    if not fits(r, rlim) then return 2 end
  end
  local deadline = now + ttl_ms
  local hs, zs, xs, caps = {ka, kr}, {kae, kre}, {a, r}, {acap, rcap}
  for i = 1, 2 do
    local x = xs[i]
    redis.call('HINCRBY', hs[i], 'held', est)
    if caps[i] >= 0 and tonumber(x[3] or '-1') ~= caps[i] then
      redis.call('HSET', hs[i], 'hold:' .. id, est, 'cap', caps[i])
    else
      redis.call('HSET', hs[i], 'hold:' .. id, est)
    end
    if not x[1] and not x[2] and not x[3] then redis.call('EXPIRE', hs[i], key_ttl) end
    redis.call('ZADD', zs[i], deadline, id)
    redis.call('EXPIRE', zs[i], key_ttl)
  end
  return 0
end
"""

# KEYS = [attempt, attempt:exp, run, run:exp]; ARGV = [call_id, est, acap, rcap, ttl_ms, key_ttl_s]
HOLD_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
""" + HOLD_FN + """
local which = ep_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                      tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], now, nil)
if which == 0 then return {1, 0} end
return {0, which}
"""

# ep_settle(...): the hold `id` released and `actual` charged, on the attempt and the run; `key_ttl` (or nil)
# refreshes the hashes' TTLs. -> {attempt's spent, run's spent}. KEYS of the caller: as ep_hold's.
SETTLE_FN = """
local function ep_settle(ka, kae, kr, kre, id, actual, key_ttl)
  local hs, zs = {ka, kr}, {kae, kre}
  local out = {}
  for i = 1, 2 do
    local amt = redis.call('HGET', hs[i], 'hold:' .. id)
    if amt then
      redis.call('HINCRBY', hs[i], 'held', -tonumber(amt))
      redis.call('HDEL', hs[i], 'hold:' .. id)
    end
    redis.call('ZREM', zs[i], id)
    out[i] = redis.call('HINCRBY', hs[i], 'spent', actual)
    if key_ttl then redis.call('EXPIRE', hs[i], key_ttl) end
  end
  return out
end
"""

# KEYS = [attempt, attempt:exp, run, run:exp]; ARGV = [call_id, actual, key_ttl_s (optional: refresh TTLs)]
SETTLE_LUA = SETTLE_FN + """
return ep_settle(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), ARGV[3])
"""

ATTEMPT_CAP, RUN_CAP = 1, 2
HOLD_SCRIPT, SETTLE_SCRIPT = Script(HOLD_LUA), Script(SETTLE_LUA)


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
    def __init__(self, redis, ref, attempt_cap_usd: float | None, run_cap_usd: float | None,
                 hold_ttl_s: float):
        a, r = keys.attempt_budget(ref), keys.run_budget(ref.run)
        self.keys = [a, a + ":exp", r, r + ":exp"]
        self.acap, self.rcap = cap_micro(attempt_cap_usd), cap_micro(run_cap_usd)
        self.ttl_ms = int(hold_ttl_s * 1000)
        self.kv = as_kv(redis)  # a redis-py client is wrapped
        self._hold = self.kv.register(HOLD_SCRIPT)
        self._settle = self.kv.register(SETTLE_SCRIPT)

    def hold_args(self, call_id: str, est_micro: int) -> list:
        """HOLD's ARGV (also the first six ARGV of the gate's HOLD+ADMIT script)."""
        return [call_id, est_micro, self.acap, self.rcap, self.ttl_ms, KEY_TTL_S]

    async def hold(self, call_id: str, est_micro: int) -> int:
        ok, which = await self.kv.script(self._hold, self.keys, self.hold_args(call_id, est_micro))
        return 0 if int(ok) == 1 else int(which)

    def settle_cmd(self, call_id: str, actual_micro: int) -> tuple:
        return self._settle.cmd(self.keys, [call_id, actual_micro, KEY_TTL_S])

    async def settle(self, call_id: str, actual_micro: int) -> None:
        await self.kv.script(self._settle, self.keys, [call_id, actual_micro, KEY_TTL_S])


class LocalBudget:
    """Same semantics in process (no Valkey configured): the run cap then only covers this attempt."""

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
