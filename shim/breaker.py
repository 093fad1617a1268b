"""A pool's outage breaker in Valkey: the pool's shims report upstream failures (unreachable, 5xx, overloaded;
never a 429, which is the pacer's) and successes; a failure streak of at least `threshold` calls lasting at least
`window_s` with no success between trips it. While it is open the shims hold new calls and the driver launches
nothing; one call at a time goes upstream as a probe (at most one every probe_s), and the first success closes it.

Valkey layout: contract.keys.pool_breaker(pool), a hash (times in ms, Valkey's clock):
  first, last, n  the failure streak (a success, or the hash expiring, starts it again; not a gap between two
                  failures: a lone call's retries back off far past the window)
  open            when it tripped (absent: closed)
  probe           no probe before this
The hash expires window + 3 probes after the last failure: an open breaker no shim probes any more (its tasks
ended) closes by itself, so the driver launches again and the new tasks find out.
FAIL   ARGV = [threshold, window_ms, probe_ms]  -> {open for ms (-1: closed), the streak's age in ms}
OK     (none)                                   -> 1 if it was open (the hash is deleted)
STATE  (none)                                   -> open for ms (-1: closed)
PROBE  ARGV = [probe_ms]                        -> 1: the caller probes now; 0: not its turn (or closed)
"""

from __future__ import annotations

import time

from contract import keys

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
"""

FAIL_LUA = _NOW + """
local threshold, window, probe = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local st = redis.call('HMGET', KEYS[1], 'first', 'last', 'n', 'open')
local first, last, n, opened = tonumber(st[1]), tonumber(st[2]), tonumber(st[3]) or 0, tonumber(st[4])
if not last then first, n = now, 0 end
n = n + 1
redis.call('HSET', KEYS[1], 'first', tostring(first), 'last', tostring(now), 'n', n)
if opened then
  redis.call('HSET', KEYS[1], 'probe', tostring(now + probe))
elseif n >= threshold and now - first >= window then
  opened = now
  redis.call('HSET', KEYS[1], 'open', tostring(now), 'probe', tostring(now + probe))
end
redis.call('PEXPIRE', KEYS[1], math.ceil(window + 3 * probe))
local streak = math.floor(now - first)
if opened then return {math.floor(now - opened), streak} end
return {-1, streak}
"""

OK_LUA = """
local opened = redis.call('HEXISTS', KEYS[1], 'open')
redis.call('DEL', KEYS[1])
return opened
"""

STATE_LUA = _NOW + """
local opened = tonumber(redis.call('HGET', KEYS[1], 'open'))
if opened then return math.floor(now - opened) end
return -1
"""

PROBE_LUA = _NOW + """
local st = redis.call('HMGET', KEYS[1], 'open', 'probe')
if not st[1] then return 0 end
local p = tonumber(st[2])
if p and p > now then return 0 end
redis.call('HSET', KEYS[1], 'probe', tostring(now + tonumber(ARGV[1])))
return 1
"""


class Breaker:
    """One pool's breaker, for a shim (redis.asyncio). `open_for_s` is read from Valkey at most every poll_s."""

    def __init__(self, redis, pool: str, threshold: int = 5, window_s: float = 10.0, probe_s: float = 5.0,
                 poll_s: float = 1.0):
        self.keys = [keys.pool_breaker(pool)]
        self.args = [threshold, window_s * 1000.0, probe_s * 1000.0]
        self.probe_ms = probe_s * 1000.0
        self.window_s = window_s
        self.streak_s: float | None = None  # the failure streak's age at this shim's last failure
        self.poll_s = poll_s
        self._fail = redis.register_script(FAIL_LUA)
        self._ok = redis.register_script(OK_LUA)
        self._state = redis.register_script(STATE_LUA)
        self._probe = redis.register_script(PROBE_LUA)
        self._open_for_s: float | None = None  # as last read; None: closed
        self._read_at = float("-inf")
        self.dirty = False  # this shim reported a failure since its last success: its next success reports
        self._ok_at = float("-inf")

    async def failed(self) -> float | None:
        """Report an upstream failure; returns how long the breaker has been open (s), None if closed."""
        self.dirty = True
        open_ms, streak_ms = await self._fail(keys=self.keys, args=self.args)
        self.streak_s = int(streak_ms) / 1000.0
        return self._saw(int(open_ms))

    def may_trip(self) -> bool:
        """The pool's failure streak, as this shim last reported to it, is younger than the window: a call out of
        retries keeps retrying until the breaker trips or the streak ends (a call would otherwise end an attempt
        in an outage the breaker had not yet had the time to see)."""
        return self._open_for_s is None and self.streak_s is not None and self.streak_s < self.window_s

    def should_report_ok(self) -> bool:
        """A success is worth a round trip when this shim failed or saw the breaker open since its last one, and
        at least once a second besides (other shims' failure streaks end with it)."""
        return self.dirty or self._open_for_s is not None or time.monotonic() - self._ok_at >= 1.0

    async def ok(self) -> bool:
        """Report a success (closes the breaker, ends the failure streak); True if it was open."""
        self.dirty, self._ok_at, self.streak_s = False, time.monotonic(), None
        was = int(await self._ok(keys=self.keys)) == 1
        self._saw(-1)
        return was

    async def open_for_s(self, fresh: bool = False) -> float | None:
        """How long the breaker has been open (s), None if closed; cached for poll_s unless `fresh`."""
        if fresh or time.monotonic() - self._read_at >= self.poll_s:
            self._saw(int(await self._state(keys=self.keys)))
        return self._open_for_s

    async def probe(self) -> bool:
        """True: the caller's call goes upstream now as the pool's probe (no other shim's does until probe_s)."""
        return int(await self._probe(keys=self.keys, args=[self.probe_ms])) == 1

    def _saw(self, open_ms: int) -> float | None:
        self._read_at = time.monotonic()
        self._open_for_s = _seconds(open_ms)
        return self._open_for_s


def open_for_s(redis, pool: str) -> float | None:
    """The same state for a synchronous reader (the driver): how long the pool's breaker has been open, or None."""
    return _seconds(int(redis.register_script(STATE_LUA)(keys=[keys.pool_breaker(pool)])))


def _seconds(open_ms: int) -> float | None:
    return None if open_ms < 0 else open_ms / 1000.0
