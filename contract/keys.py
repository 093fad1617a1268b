"""Valkey key names, in one place. Curly-brace hash tags keep one run's (or pool's) keys on one shard.

Imports nothing at run time: every process that touches Valkey reads its names from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contract.models import AttemptRef

PROGRESS_TTL_S = 120  # a task that stops refreshing its progress key is presumed dead after this


def progress(ref: AttemptRef) -> str:
    """Live progress of one attempt (hash, TTL): the dashboard and the resume logic read it."""
    return f"ep:run:{{{ref.run}}}:progress:{ref.instance_id}:{ref.attempt}"


# A field of the progress hash, set by the driver just before it stops the task itself (value: why, e.g. "cancel").
# A task stopped without it (Spot taking its capacity back, an operator's StopTask) sends no result of its own.
PROGRESS_STOPPED_BY = "stopped_by"


def progress_pattern(run: str) -> str:
    return f"ep:run:{{{run}}}:progress:*"


def run_budget(run: str) -> str:
    """Run-level spend: fields spent, held (USD as integer micro-dollars)."""
    return f"ep:run:{{{run}}}:budget"


def attempt_budget(ref: AttemptRef) -> str:
    return f"ep:run:{{{ref.run}}}:attempt:{ref.instance_id}:{ref.attempt}:budget"


def pool_pacer(pool: str) -> str:
    """GCRA state of one pool (hash: one TAT field per dimension)."""
    return f"ep:pool:{{{pool}}}:pacer"


def pool_limits(pool: str) -> str:
    """Limits the pacer applies to a pool (hash: rpm, itpm, otpm), owned by the dispatcher's PoolPacer."""
    return f"ep:pool:{{{pool}}}:limits"


def pool_discovered(pool: str) -> str:
    """Rate-limit headers the shims saw for a pool (hash: header -> value)."""
    return f"ep:pool:{{{pool}}}:discovered"


def pool_state(pool: str) -> str:
    """The PoolPacer's own state (JSON), so a restarted actor resumes where it was."""
    return f"ep:pool:{{{pool}}}:state"


def pool_breaker(pool: str) -> str:
    """A pool's outage breaker (hash: first, last, n = the failure streak; open = when it tripped; probe = no probe
    before this), shared by the pool's shims and read by the driver (shim/breaker.py)."""
    return f"ep:pool:{{{pool}}}:breaker"


def run_hold(run: str) -> str:
    """Set while a run's operators hold its model calls (`pause --hold-calls`; the value: when, epoch seconds): its
    shims hold each new call until it is gone (shim/hold.py). Written with the runs row, by the control commands;
    outside ep:run:{run}:*, so a run's own Valkey user may read it and not lift it."""
    return f"ep:hold:{{{run}}}"


THROTTLED_FIELD = "throttled_total"  # in pool_discovered: the shims' running count of provider 429s


# ---------------------------------------------------------------- the dashboard's keys, written by the dispatcher
# Under ep:live:, not ep:run:, so they outlive the run's own keys (removed at its end) and the dashboard can show
# how a run ended; they expire LIVE_TTL_S after the run's last update.

LIVE_TTL_S = 7 * 24 * 3600


def live_runs() -> str:
    """Runs the dispatcher has published (zset: run -> last update, epoch seconds): the dashboard's run list."""
    return "ep:live:runs"


def run_live(run: str) -> str:
    """The driver's view of a run (hash): state, planned, landed, status:<STATUS> counts, running, target, pool,
    caps, started_at, updated_at; at the end, spent_usd and calls from the ledger."""
    return f"ep:live:{{{run}}}"


def run_live_running(run: str) -> str:
    """The attempts the driver has a task for (set of "<instance_id>/<attempt>"): whose progress keys to read."""
    return f"ep:live:{{{run}}}:running"


def pool_live(pool: str) -> str:
    """A pool's recent pacing as the driver measured it from the ledger (hash: admitted_per_min, wait_share,
    calls, window_s, updated_at)."""
    return f"ep:pool:{{{pool}}}:live"


# ---------------------------------------------------------------- the gateway tier's keys (gateway/)


def gateway_key(key_hash: str) -> str:
    """A live gateway key (hash: owner, aliases, budget_usd, expires_at), expiring with it; deleted on revocation."""
    return f"ep:gw:key:{key_hash}"


def gateway_spend(owner: str) -> str:
    """What the gateway's meter has counted against a key's owner (integer micro-dollars)."""
    return f"ep:gw:{{{owner}}}:spend"


def gateway_answer(key_hash: str, attempt: str) -> str:
    """A non-stream answer a replica gave to one upstream attempt under a key (hash: h, its headers as JSON; b, its
    body), kept briefly for a retry of it (gateway/replay.py)."""
    return f"ep:gw:answer:{key_hash}:{attempt}"


def gateway_rows(database: str) -> str:
    """The gateway's meter rows (JSON list) on their way to one PostgreSQL database (a digest of its host, port and
    name: tiers writing to other databases share the Valkey, not their rows)."""
    return f"ep:gw:rows:{{{database}}}"


def gateway_drain_lock(database: str) -> str:
    """Held by the one replica moving rows to that database at a time."""
    return f"ep:gw:rows:{{{database}}}:drain"
