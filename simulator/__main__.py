"""CLI: `python -m simulator --port 0 --port-file PATH [options]`; the options are SimulatorConfig's fields."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

from aiohttp import web

from simulator.app import make_app
from simulator.config import SimulatorConfig, flag

API_KEY_ENV = "SIMULATOR_API_KEY"  # the key to accept, as --api-key, but out of /proc/<pid>/cmdline


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, SimulatorConfig]:
    parser = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 binds a free port")
    parser.add_argument("--port-file", type=Path, help="write the bound port here")
    for name, info in SimulatorConfig.model_fields.items():
        parser.add_argument(
            flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{info.description} (default: {info.default})",
        )
    args = parser.parse_args(argv)
    if "api_key" not in vars(args) and os.environ.get(API_KEY_ENV):  # a key in argv is readable by every user
        args.api_key = os.environ[API_KEY_ENV]
    server = {k: vars(args).pop(k) for k in ("host", "port", "port_file")}
    try:
        config = SimulatorConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
    return argparse.Namespace(**server), config


async def serve(server: argparse.Namespace, config: SimulatorConfig) -> None:
    runner = web.AppRunner(make_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.host, server.port)
    await site.start()
    port = runner.addresses[0][1]
    if server.port_file:
        tmp = server.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, server.port_file)  # readers never see a half-written file
    print(f"simulator listening on http://{server.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    server, config = parse_args(argv)
    asyncio.run(serve(server, config))


if __name__ == "__main__":
    main()
