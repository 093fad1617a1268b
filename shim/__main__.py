"""python -m shim --config shim.json   (the upstream key comes only from $SHIM_UPSTREAM_KEY)

Exit status: 0 after a clean SIGTERM/SIGINT shutdown with every ledger row sent (or no queue configured),
3 if ledger rows could not be sent to the results queue (they remain in ledger_path), 2 on bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import uvloop

from shim.config import UPSTREAM_KEY_ENV, ConfigError, ShimConfig


class _Redact(logging.Filter):
    """Belt and braces: no log line may carry the upstream key, whatever formatted it."""

    def __init__(self, secret: str):
        super().__init__()
        self.secret = secret

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secret:
            msg = record.getMessage()
            if self.secret in msg:
                record.msg = msg.replace(self.secret, "[REDACTED]")
                record.args = None
        return True


def _logging(secret: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_Redact(secret))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("SHIM_LOG_LEVEL", "INFO"))
    for noisy in ("botocore", "boto3", "urllib3", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


async def _main(cfg: ShimConfig, key: str | None) -> int:
    from shim.server import Shim

    shim = Shim(cfg, key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await shim.start()
    await stop.wait()
    logging.getLogger("shim").info("signal received, shutting down")
    sent_all = await shim.stop()
    return 0 if sent_all else 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path, help="ShimConfig JSON file")
    args = ap.parse_args(argv)
    key = os.environ.get(UPSTREAM_KEY_ENV) or None
    _logging(key or "")
    try:
        cfg = ShimConfig.model_validate_json(args.config.read_text())
    except (OSError, ConfigError) as e:
        logging.getLogger("shim").error("bad config %s: %s", args.config, e)
        return 2
    if key is None:
        logging.getLogger("shim").warning("%s is not set: calls go upstream without a key", UPSTREAM_KEY_ENV)
    return uvloop.run(_main(cfg, key))  # a faster event loop: less CPU per call


if __name__ == "__main__":
    sys.exit(main())
