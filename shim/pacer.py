"""Pool pacing: GCRA admission in Valkey over all of a pool's limits at once (rpm, itpm, otpm).

Why GCRA over a hash: one atomic script checks every dimension and books them all-or-nothing; the
state is one timestamp (TAT, ms) per dimension, so a crashed shim leaks nothing (its booking decays
by itself), and a refusal returns the exact wait, so a caller sleeps once instead of polling.

Valkey layout (both keys share the pool's hash tag, so one script touches one shard):
  contract.keys.pool_limits(pool)  hash rpm, itpm, otpm: per-minute limits, written by the dispatcher's
                                   PoolPacer and read inside the script on every admission (a missing or
                                   non-positive field = that dimension is unlimited)
  contract.keys.pool_pacer(pool)   hash rpm, itpm, otpm: TAT per dimension (ms, float; the moment the
                                   dimension's bucket is full again); until: no admission before this (ms),
                                   set by a provider 429's retry-after. PEXPIREd once every TAT is past.
  contract.keys.pool_discovered(pool)  THROTTLED_FIELD is HINCRBY'd on every upstream 429.

ADMIT  KEYS = [pacer, limits]; ARGV = [burst_ms, max_wait_ms, cost_rpm, cost_itpm, cost_otpm]
  Per limited dimension i: T_i = 60000 / limit_i ms per unit; B_i = max(burst_ms, cost_i * T_i) (a call
  bigger than the burst goes when the bucket is full); earliest start s_i = max(now, tat_i + cost_i*T_i - B_i).
  s = max(now, until, max_i s_i); wait = s - now. If wait > max_wait_ms: returns {0, wait} and books
  nothing. Else books tat_i = max(tat_i, s) + cost_i*T_i for every limited dimension and returns {1, wait}:
  the caller sleeps `wait` ms once and goes; its capacity is already reserved.
SETTLE KEYS = [pacer, limits]; ARGV = [delta_itpm, delta_otpm, delta_rpm (optional; -1 cancels a booking
  that was never used)] (actual - reserved, units)
  Refund (delta < 0): tat = max(tat + delta*T, now), so a refund never makes a bucket fuller than full.
  Charge (delta > 0): tat = max(tat, now) + delta*T.
THROTTLE KEYS = [pacer, limits, discovered]; ARGV = [retry_after_ms, burst_ms, dimension or '', field]
  until = max(until, now + retry_after); the named dimension (or every limited one when the 429 does not
  say) is emptied at that moment: tat = max(tat, now + retry_after + burst_ms). HINCRBY discovered field 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from contract import keys

# ep_admit(...) -> {admitted 0/1, wait_ms}; `now` in ms (float). KEYS of the caller: pacer hash, limits hash.
ADMIT_FN = """
local function ep_admit(kp, kl, burst, max_wait, c_rpm, c_itpm, c_otpm, now)
  local lim = redis.call('HMGET', kl, 'rpm', 'itpm', 'otpm')
  local st = redis.call('HMGET', kp, 'rpm', 'itpm', 'otpm', 'until')
  local s = now
  local u = tonumber(st[4])
  if u and u > s then s = u end
  local names = {'rpm', 'itpm', 'otpm'}
  local costs = {c_rpm, c_itpm, c_otpm}
  local per, cost, tat = {}, {}, {}
  for i = 1, 3 do
    local l = tonumber(lim[i])
    cost[i] = costs[i]
    if l and l > 0 and cost[i] > 0 then
      per[i] = 60000 / l
      tat[i] = tonumber(st[i]) or now
      local need = cost[i] * per[i]
      local b = burst
      if need > b then b = need end
      local si = tat[i] + need - b
      if si > s then s = si end
    end
  end
  local wait = s - now
  if wait > max_wait then return {0, math.ceil(wait)} end
  local hi = s
  local set = {}
  for i = 1, 3 do
    if per[i] then
      local base = tat[i]
      if s > base then base = s end
      local nt = base + cost[i] * per[i]
      set[#set + 1] = names[i]
      set[#set + 1] = tostring(nt)
      if nt > hi then hi = nt end
    end
  end
  if #set > 0 then redis.call('HSET', kp, unpack(set)) end
  if hi > now then redis.call('PEXPIRE', kp, math.ceil(hi - now) + 60000) end
  return {1, math.ceil(wait)}
end
"""

# KEYS = [pacer, limits]; ARGV = [burst_ms, max_wait_ms, cost_rpm, cost_itpm, cost_otpm]
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
""" + ADMIT_FN + """
return ep_admit(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
                tonumber(ARGV[5]), now)
"""

# ep_settle_pool(...): reconcile a booking with what the attempt used (deltas: actual - reserved; d_rpm -1 gives
# a request back); `now` in ms (float). KEYS of the caller: pacer hash, limits hash.
SETTLE_FN = """
local function ep_settle_pool(kp, kl, d_in, d_out, d_rpm, now)
  local lim = redis.call('HMGET', kl, 'itpm', 'otpm', 'rpm')
  local st = redis.call('HMGET', kp, 'itpm', 'otpm', 'rpm')
  local fields = {'itpm', 'otpm', 'rpm'}
  local ds = {d_in, d_out, d_rpm}
  local hi = 0
  for i = 1, 3 do
    local l = tonumber(lim[i])
    local d = ds[i]
    if l and l > 0 and d ~= 0 then
      local per = 60000 / l
      local tat = tonumber(st[i]) or now
      local nt
      if d < 0 then
        nt = tat + d * per
        if nt < now then nt = now end
      else
        nt = tat
        if now > nt then nt = now end
        nt = nt + d * per
      end
      redis.call('HSET', kp, fields[i], tostring(nt))
      if nt > hi then hi = nt end
    end
  end
  if hi > now then
    local ttl = redis.call('PTTL', kp)
    local want = math.ceil(hi - now) + 60000
    if ttl < want then redis.call('PEXPIRE', kp, want) end
  end
  return 1
end
"""

# KEYS = [pacer, limits]; ARGV = [delta_itpm, delta_otpm, delta_rpm (optional)]
SETTLE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
""" + SETTLE_FN + """
return ep_settle_pool(KEYS[1], KEYS[2], tonumber(ARGV[1] or '0'), tonumber(ARGV[2] or '0'), tonumber(ARGV[3] or '0'),
                      now)
"""

THROTTLE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local ra = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local at = now + ra
local u = tonumber(redis.call('HGET', KEYS[1], 'until'))
if not u or u < at then redis.call('HSET', KEYS[1], 'until', tostring(at)) end
local names = {'rpm', 'itpm', 'otpm'}
local lim = redis.call('HMGET', KEYS[2], 'rpm', 'itpm', 'otpm')
local st = redis.call('HMGET', KEYS[1], 'rpm', 'itpm', 'otpm')
for i = 1, 3 do
  local l = tonumber(lim[i])
  if l and l > 0 and (ARGV[3] == '' or ARGV[3] == names[i]) then
    local tat = tonumber(st[i]) or now
    if tat < at + burst then redis.call('HSET', KEYS[1], names[i], tostring(at + burst)) end
  end
end
redis.call('PEXPIRE', KEYS[1], math.ceil(ra + burst) + 60000)
return redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
"""


@dataclass(slots=True)
class PaceRequest:
    """What one upstream attempt reserves: 1 request, its input estimate, max_tokens of output."""

    pool: str
    est_input_tokens: int  # what counts toward the pool's input limit (see Shim._limit_input)
    max_output_tokens: int


class PastDeadline(Exception):
    """Waiting for the pool would take the call past the attempt's wall time."""


class Pacer(Protocol):
    async def admit(self, req: PaceRequest, deadline: float | None = None) -> float:
        """Wait until the pool can take the attempt; return the time waited in ms."""

    async def settle(self, req: PaceRequest, actual_input: int | None, actual_output: int | None) -> None:
        """Reconcile the reservation with what the attempt used (None: refund nothing for that dimension)."""

    async def throttled(self, req: PaceRequest, retry_after_s: float | None, dimension: str | None) -> None:
        """A provider 429: hold the pool back and count it for the dispatcher's PoolPacer."""


class NoopPacer:
    async def admit(self, req: PaceRequest, deadline: float | None = None) -> float:
        return 0.0

    async def settle(self, req: PaceRequest, actual_input: int | None, actual_output: int | None) -> None:
        return None

    async def throttled(self, req: PaceRequest, retry_after_s: float | None, dimension: str | None) -> None:
        return None


class ValkeyPacer:
    """GCRA in Valkey (see the module docstring), through redis-py's registered scripts (reloaded on NOSCRIPT)."""

    def __init__(self, redis, pool: str, burst_s: float = 60.0, max_wait_s: float = 60.0,
                 default_retry_after_s: float = 1.0, max_retry_after_s: float = 60.0):
        self.keys = [keys.pool_pacer(pool), keys.pool_limits(pool)]
        self.throttle_keys = [*self.keys, keys.pool_discovered(pool)]
        self.burst_ms = burst_s * 1000.0
        self.max_wait_ms = max_wait_s * 1000.0
        self.default_ra_ms = default_retry_after_s * 1000.0
        self.max_ra_ms = max_retry_after_s * 1000.0
        self._admit = redis.register_script(ADMIT_LUA)
        self._settle = redis.register_script(SETTLE_LUA)
        self._throttle = redis.register_script(THROTTLE_LUA)

    def admit_args(self, req: PaceRequest) -> list:
        """ADMIT's ARGV (also the last five of the HOLD+ADMIT script's: shim/admission.py)."""
        return [self.burst_ms, self.max_wait_ms, 1, max(req.est_input_tokens, 0), max(req.max_output_tokens, 0)]

    async def admit(self, req: PaceRequest, deadline: float | None = None) -> float:
        ok, wait_ms = await self._admit(keys=self.keys, args=self.admit_args(req))
        return await self.admitted(req, int(ok) == 1, float(wait_ms), deadline)

    async def admitted(self, req: PaceRequest, ok: bool, wait_ms: float, deadline: float | None = None) -> float:
        """Act on an ADMIT answer: sleep once for a booked wait; when too far ahead to book, sleep until it
        would fit in max_wait, then ask again (rare; no polling storm). Returns the total ms waited.
        PastDeadline (nothing left booked) if the wait would pass `deadline` (time.monotonic())."""
        waited = 0.0
        while not ok:
            if deadline is not None and time.monotonic() + wait_ms / 1000.0 > deadline:
                raise PastDeadline(waited + wait_ms)
            nap = max(wait_ms - self.max_wait_ms, 1.0)
            await asyncio.sleep(nap / 1000.0)
            waited += nap
            ok, wait_ms = await self._admit(keys=self.keys, args=self.admit_args(req))
            ok, wait_ms = int(ok) == 1, float(wait_ms)
        if wait_ms > 0:
            if deadline is not None and time.monotonic() + wait_ms / 1000.0 > deadline:
                await self.cancel(req)
                raise PastDeadline(waited + wait_ms)
            await asyncio.sleep(wait_ms / 1000.0)
        return waited + max(wait_ms, 0.0)

    @staticmethod
    def settle_args(req: PaceRequest, actual_input: int | None, actual_output: int | None) -> list[int]:
        """SETTLE's ARGV: actual - reserved (0: nothing to reconcile)."""
        d_in = 0 if actual_input is None else actual_input - req.est_input_tokens
        d_out = 0 if actual_output is None else actual_output - req.max_output_tokens
        return [d_in, d_out]

    async def settle(self, req: PaceRequest, actual_input: int | None, actual_output: int | None) -> None:
        args = self.settle_args(req, actual_input, actual_output)
        if any(args):
            await self._settle(keys=self.keys, args=args)

    async def cancel(self, req: PaceRequest) -> None:
        """Give a booking that will not be used back to the pool: its request and both token estimates."""
        await self._settle(keys=self.keys, args=[-req.est_input_tokens, -req.max_output_tokens, -1])

    async def throttled(self, req: PaceRequest, retry_after_s: float | None, dimension: str | None) -> None:
        ra_ms = self.default_ra_ms if retry_after_s is None else retry_after_s * 1000.0
        await self._throttle(keys=self.throttle_keys,
                             args=[min(ra_ms, self.max_ra_ms), self.burst_ms, dimension or "", keys.THROTTLED_FIELD])


_DIM_HEADERS = (
    ("anthropic-ratelimit-requests-remaining", "rpm"),
    ("anthropic-ratelimit-input-tokens-remaining", "itpm"),
    ("anthropic-ratelimit-output-tokens-remaining", "otpm"),
    ("x-ratelimit-remaining-requests", "rpm"),
    ("x-ratelimit-remaining-tokens", "itpm"),
)


def throttled_dimension(headers: Mapping[str, str] | None, body: bytes) -> str | None:
    """Which pool dimension a 429 names, from the *-remaining headers at 0 or the error text; None = unknown."""
    if headers:
        for prefix in ("", "llm_provider-"):
            for name, dim in _DIM_HEADERS:
                v = headers.get(prefix + name)
                if v is not None and v.strip() == "0":
                    return dim
    low = body[:2000].lower()
    if b"output tokens per minute" in low or b"output_tokens" in low:
        return "otpm"
    if b"input tokens per minute" in low or b"tokens per min" in low:
        return "itpm"
    if b"requests per min" in low or b"requests per minute" in low:
        return "rpm"
    return None
