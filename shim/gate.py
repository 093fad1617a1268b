"""The Valkey round trip before a call is forwarded (the budget hold and the pacer admission of its first
upstream attempt, in one Lua script), and tickets: that round trip taken ahead, for the next call.

HOLD+ADMIT  KEYS = [attempt, attempt:exp, run, run:exp, pacer, limits] (caps.py's four, then pacer.py's two)
            ARGV = HOLD's six, then ADMIT's five, then the run room (optional, see tickets)
  -> {held, which, admitted, wait_ms}
  If the hold does not fit: {0, which cap, 0, 0}, and nothing is booked with the pacer (a refused call takes
  no pool capacity). Else the hold is taken and ADMIT runs as alone: {1, 0, 1, wait} booked (sleep `wait`
  once), or {1, 0, 0, wait} when too far ahead to book (ValkeyPacer.admitted sleeps and asks ADMIT again).

Tickets. A round trip to Valkey costs a call 0.2-0.4 ms on an idle machine (more than the rest of the shim's
work). So when a call ends, the same background script that settles it (AFTER) also runs HOLD+ADMIT for a call
that has not come yet: a ticket. The next call that the ticket covers (its worst-case cost at most the
ticket's hold) goes without asking Valkey: its hold is already taken, its pool booking made (it sleeps until
the booked slot if it comes early); a call the ticket does not cover gives it back and asks as before, in the
same round trip. Every call is still held and admitted before it is forwarded; what changes:
  - a ticket's hold is a little larger than the next call's (the prompt grows each turn): it is held only
    while the run's spent + held stays within `ticket_room` of the run cap, so near the run cap tickets stop
    and holds are exactly as without them (tickets never make a call be refused);
  - its pool booking is made up to `ticket_ttl_s` before the call; the settle after the call reconciles the
    estimate with the actual usage as before;
  - a ticket not used within `ticket_ttl_s` (the harness is busy, or finished) is given back: hold released,
    booking (request and tokens) refunded; also at shutdown. A task killed outright leaks it as it would
    leak an in-flight call's: the hold expires (hold_ttl_s), the booking decays.
A shim keeps at most as many tickets as it has calls in flight, so a harness making one call at a time holds
one ticket at most (Gate.tickets_wanted).

The run's keys ({run} hash tag) and the pool's ({pool}) are on one node: the deployed Valkey is a replication
group (one primary, cluster mode off). A cluster would need the two scripts pipelined instead.

Without a Valkey budget and pacer (local caps, or a pacer injected by a test), the hold and the admission are
made one after the other, as before, and there are no tickets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from shim.caps import HOLD_FN, KEY_TTL_S, Budget, ValkeyBudget
from shim.caps import SETTLE_FN as BUDGET_SETTLE_FN
from shim.kv import Script
from shim.pacer import ADMIT_FN, Pacer, PaceRequest, ValkeyPacer
from shim.pacer import SETTLE_FN as POOL_SETTLE_FN

log = logging.getLogger("shim.gate")

HOLD_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
""" + HOLD_FN + ADMIT_FN + """
local which = ep_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                      tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], math.floor(now), tonumber(ARGV[12]))
if which ~= 0 then return {0, which, 0, 0} end
local a = ep_admit(KEYS[5], KEYS[6], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]),
                   tonumber(ARGV[11]), now)
return {1, 0, a[1], a[2]}
"""
HOLD_ADMIT_SCRIPT = Script(HOLD_ADMIT_LUA)

# A call's bookkeeping in one script (Gate.after_cmd), rather than a pipeline of five commands: the budget settle,
# the pool settle, the progress hash (HSET and EXPIRE) and the next call's ticket(s) (HOLD+ADMIT each). Why: each
# command costs the shim a packing and a reply. Measured side by side (docs/shim.md): the shim's CPU per call −2%
# and −6%; Valkey's 0% and −5% (the scripts' own work is most of Valkey's cost per call, not the commands).
#   KEYS = [attempt, attempt:exp, run, run:exp, pacer, limits, progress]
#   ARGV = [hold id to settle ('' = none), actual micro-dollars, key_ttl_s, pool delta input, pool delta output,
#           progress TTL s, n progress field/value pairs, the 2n of them, then the twelve HOLD+ADMIT ARGV of each
#           ticket (HOLD's six, ADMIT's five, the run room)]
#   -> one {held, which, admitted, wait_ms} per ticket, as HOLD+ADMIT's
AFTER_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
""" + HOLD_FN + ADMIT_FN + BUDGET_SETTLE_FN + POOL_SETTLE_FN + """
if ARGV[1] ~= '' then ep_settle(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[2]), ARGV[3]) end
local d_in, d_out = tonumber(ARGV[4]), tonumber(ARGV[5])
if d_in ~= 0 or d_out ~= 0 then ep_settle_pool(KEYS[5], KEYS[6], d_in, d_out, 0, now) end
local n = tonumber(ARGV[7])
if n > 0 then
  redis.call('HSET', KEYS[7], unpack(ARGV, 8, 7 + 2 * n))
  redis.call('EXPIRE', KEYS[7], ARGV[6])
end
local out = {}
local i = 8 + 2 * n
while i + 11 <= #ARGV do
  local which = ep_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]),
                        tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), ARGV[i + 5], math.floor(now),
                        tonumber(ARGV[i + 11]))
  if which ~= 0 then
    out[#out + 1] = {0, which, 0, 0}
  else
    local a = ep_admit(KEYS[5], KEYS[6], tonumber(ARGV[i + 6]), tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8]),
                       tonumber(ARGV[i + 9]), tonumber(ARGV[i + 10]), now)
    out[#out + 1] = {1, 0, a[1], a[2]}
  end
  i = i + 12
end
return out
"""
AFTER_SCRIPT = Script(AFTER_LUA)


class Gated(NamedTuple):
    """What the gate decided for one call. which = 0 if held (under `hold_id`), else the cap that refused it
    (then nothing else happened). When held and `answered`, (ok, wait_ms) is the ADMIT answer for the first
    attempt, booked as `pace`, to act on with ValkeyPacer.admitted; when not `answered`, the caller admits the
    attempt itself (pacer.admit)."""

    which: int
    ok: bool
    wait_ms: float
    answered: bool
    hold_id: str
    pace: PaceRequest


# what a call asks of the gate: () -> (its worst-case cost in micro-dollars, its pool booking)
Need = Callable[[], tuple[int, PaceRequest]]


@dataclass(slots=True)
class Ticket:
    hold_id: str
    est_micro: int
    pace: PaceRequest
    size: tuple[int, int] | None  # the (request bytes, max output tokens) est_micro was computed for
    booked: bool  # the pool booking was made (else: too far ahead; the call admits itself)
    start_at: float  # monotonic: the booked slot
    expires_at: float  # monotonic
    asked: bool = False  # made for a call the compiled data plane asked about (Shim._ask), not taken ahead


class Gate:
    def __init__(self, budget: Budget, pacer: Pacer, ticket_ttl_s: float = 0.0, ticket_room: float = 0.8):
        self.budget = budget
        self.pacer = pacer
        self.combined = (isinstance(budget, ValkeyBudget) and isinstance(pacer, ValkeyPacer)
                         and budget.kv is pacer.kv)
        self.ticket_ttl_s = ticket_ttl_s if self.combined else 0.0
        self.tickets: deque[asyncio.Future] = deque()  # each resolves to a Ticket, or None (not taken)
        self._first_expiry = float("inf")  # no ticket taken expires before this (monotonic)
        self.stats = {"taken": 0, "used": 0, "returned": 0}
        self._loop: asyncio.AbstractEventLoop | None = None  # kept (get_running_loop() is a getpid(2) on 3.11)
        if self.combined:
            self.kv = budget.kv
            self.script = self.kv.register(HOLD_ADMIT_SCRIPT)
            self.after_script = self.kv.register(AFTER_SCRIPT)
            self.keys = [*budget.keys, *pacer.keys]
            rcap = budget.rcap
            self.run_room = -1 if rcap < 0 else int(rcap * ticket_room)

    def _hold_admit_args(self, call_id: str, est_micro: int, pace: PaceRequest, room: int | None = None) -> list:
        args = [*self.budget.hold_args(call_id, est_micro), *self.pacer.admit_args(pace)]
        if room is not None:
            args.append(room)
        return args

    def _hold_admit(self, call_id: str, est_micro: int, pace: PaceRequest, room: int | None = None) -> tuple:
        return self.script.cmd(self.keys, self._hold_admit_args(call_id, est_micro, pace, room))

    def after_cmd(self, hold_id: str | None, actual_micro: int, pool_deltas: list[int] | None,
                  progress: tuple[str, int, list], tickets: list[list]) -> tuple:
        """A call's bookkeeping as one command (AFTER_LUA; combined gates only): settle its hold `hold_id` at
        `actual_micro`, its last pool booking by `pool_deltas` ([input, output], actual - reserved; None: nothing to
        reconcile), write `progress` (key, TTL s, flat field/value list: Progress.update) and take `tickets` (each
        from ticket_args()). Replies: one HOLD+ADMIT answer per ticket."""
        d_in, d_out = pool_deltas or (0, 0)
        pkey, pttl, flat = progress
        args = [hold_id or "", actual_micro, KEY_TTL_S, d_in, d_out, pttl, len(flat) // 2, *flat]
        for t in tickets:
            args += t
        return self.after_script.cmd([*self.keys, pkey], args)

    async def hold(self, call_id: object, need: Need, size: tuple[int, int] | None = None) -> Gated:
        """Hold the call's worst case, then admit its first attempt: with a ticket that covers it (no round
        trip), else with HOLD+ADMIT (giving back, in the same round trip, a ticket that does not cover it).
        `need()` is asked only if no ticket covers the call by `size` (its request bytes and max output tokens:
        a caller whose worst case never shrinks as either grows can say so, and a call no larger than a ticket's
        is covered without pricing it). `call_id`: its str() is the hold's id."""
        est_micro = pace = None
        if not self.combined:
            est_micro, pace = need()
            which = await self.budget.hold(str(call_id), est_micro)
            return Gated(which, False, 0.0, False, str(call_id), pace)
        give_back: list[tuple] = []
        while self.tickets:
            fut = self.tickets.popleft()
            if not fut.done():
                self.kv.kick()  # the ticket's request may still wait for its write: send it now
                try:
                    await asyncio.shield(fut)
                except Exception:  # noqa: BLE001 - an unknown ticket is simply not used
                    continue
            t: Ticket | None = fut.result()
            if t is None:
                continue
            now = time.monotonic()
            if now < t.expires_at:
                covers = size is not None and t.size is not None and size[0] <= t.size[0] and size[1] <= t.size[1]
                if not covers:
                    if est_micro is None:
                        est_micro, pace = need()
                    covers = est_micro <= t.est_micro
                if covers:
                    self.stats["used"] += 1
                    if not t.booked:
                        return Gated(0, False, 0.0, False, t.hold_id, t.pace)
                    return Gated(0, True, max(0.0, (t.start_at - now) * 1000), True, t.hold_id, t.pace)
            give_back += self.give_back_cmds(t)
            break  # one ticket per call: the others stay for the calls beside it
        if est_micro is None:
            est_micro, pace = need()
        call_id = str(call_id)
        cmds = [*give_back, self._hold_admit(call_id, est_micro, pace)]
        replies = await self.kv.pipeline(cmds)
        for r in replies[:-1]:
            if isinstance(r, Exception):
                log.warning("giving a ticket back failed: %s", r)
        if isinstance(replies[-1], Exception):
            raise replies[-1]
        held, which, ok, wait_ms = replies[-1]
        if int(held) != 1:
            return Gated(int(which), False, 0.0, False, call_id, pace)
        return Gated(0, int(ok) == 1, float(wait_ms), True, call_id, pace)

    # ------------------------------------------------------------ tickets

    def tickets_wanted(self, in_flight: int, lent: int = 0) -> int:
        """How many tickets a call answered now should ask for: never more than one per call in flight (this one
        included); one for a call alone; while calls overlap, up to two until there is one per call in flight.
        Why two: with calls overlapping, the next call (often the same caller's, at once) takes the oldest
        ticket; a ticket asked for now is a round trip (with the compiled data plane, a batched `end` line and a
        round trip) away, so the stock must run ahead of the calls. Measured at c=16 against an instant
        simulator with the compiled data plane: up to one more only when none was left, 50% of calls found no
        ticket; up to two while short, 12-24% (bench/bench_shim.py prints the share). A harness making one call
        at a time never holds more than one."""
        have = len(self.tickets) + lent  # lent: those the compiled data plane holds (shim/front.py)
        if self.ticket_ttl_s <= 0 or have >= in_flight:
            return 0
        return min(in_flight - have, 2) if in_flight > 1 else 1

    def ticket_args(self, hold_id: str, est_micro: int, pace: PaceRequest,
                    size: tuple[int, int] | None = None) -> tuple[list, _Pending]:
        """HOLD+ADMIT's ARGV for a call not yet made (for after_cmd), and the pending ticket to resolve with
        ticket_taken() once the reply is in. `hold_id`: unique within the attempt; `size`: what `est_micro` was
        computed for (see hold)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        p = _Pending(loop.create_future(), hold_id, est_micro, pace, size)
        self.tickets.append(p.fut)
        return self._hold_admit_args(p.hold_id, est_micro, pace, self.run_room), p

    def ticket_taken(self, p: _Pending, reply) -> None:
        """The reply to a ticket's HOLD+ADMIT (an exception if it failed or never came)."""
        if p.fut.done():
            return
        if isinstance(reply, BaseException) or int(reply[0]) != 1:
            if isinstance(reply, BaseException):
                log.warning("taking a ticket failed: %s", type(reply).__name__)
            p.fut.set_result(None)  # if the hold was taken after all, it expires (hold_ttl_s)
            self._first_expiry = 0.0  # the next expired_cmds drops it (so that it does not count as a ticket)
            return
        _, _, ok, wait_ms = reply
        now = time.monotonic()
        self.stats["taken"] += 1
        self._first_expiry = min(self._first_expiry, now + self.ticket_ttl_s)
        p.fut.set_result(Ticket(p.hold_id, p.est_micro, p.pace, p.size, int(ok) == 1,
                                now + float(wait_ms) / 1000, now + self.ticket_ttl_s))

    def give_back_cmds(self, t: Ticket) -> list[tuple]:
        """A ticket given back: its hold released and its pool booking refunded."""
        self.stats["returned"] += 1
        cmds = [self.budget.settle_cmd(t.hold_id, 0)]
        if t.booked:
            cmds.append(self.pacer.cancel_cmd(t.pace))
        return cmds

    def expired_cmds(self, everything: bool = False) -> list[tuple]:
        """Give back tickets past their time (all of them: `everything`, at shutdown): their commands."""
        now = time.monotonic()
        if not everything and now < self._first_expiry:
            return []  # nothing to give back yet (the usual case: called after every call)
        self._first_expiry = float("inf")
        cmds: list[tuple] = []
        keep: deque[asyncio.Future] = deque()
        for fut in self.tickets:
            if not fut.done():
                keep.append(fut)
                continue
            t = fut.result()
            if t is None:
                continue
            if everything or now >= t.expires_at:
                cmds += self.give_back_cmds(t)
            else:
                keep.append(fut)
                self._first_expiry = min(self._first_expiry, t.expires_at)
        self.tickets = keep
        return cmds


class Demand:
    """How many calls the compiled data plane's tickets should cover (the `in_flight` for Gate.tickets_wanted).
    Its calls in flight as of one `end` understate it when calls are short: against an instant simulator at c=16 a
    call spends most of its time in the harness, and 20-30% of calls found no ticket and asked for one. So: the
    most calls in flight at once over the last window (about a second), and, while calls overlap, one more for
    each call that had to ask lately (each ask: the stock was one short), halved each window, up to the peak again
    (so at most twice the peak). A harness making one call at a time still holds one ticket at most. Measured
    side by side at c=16 (docs/shim.md): asks 16-33% of calls before, 3% after."""

    __slots__ = ("at", "peak", "short", "window_s")

    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self.peak = 0  # the most calls in flight at once in this window (the one ending included)
        self.at = float("-inf")  # monotonic: when this window began
        self.short = 0  # asks lately

    def ended(self, others: int, now: float) -> None:
        """A call ended with `others` still in flight."""
        if now - self.at >= self.window_s:
            self.peak, self.at, self.short = others + 1, now, self.short // 2
        elif others >= self.peak:
            self.peak = others + 1

    def asked(self) -> None:
        self.short = min(self.short + 1, 64)

    def calls(self, in_flight: int) -> int:
        return max(in_flight, self.peak) + (min(self.short, self.peak) if self.peak > 1 else 0)


@dataclass(slots=True)
class _Pending:
    fut: asyncio.Future
    hold_id: str
    est_micro: int
    pace: PaceRequest
    size: tuple[int, int] | None
