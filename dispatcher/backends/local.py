"""The local backend: everything on this host. moto for S3 and SQS, the project's Valkey (each run its own user),
the provider simulator unless model.base_url names a gateway, eval workers as local processes, and tasks launched
by the process launcher (a subprocess on a checkout of the instance's bundle) or the docker launcher (a container
from its task image, behind the egress). Task images are built here, on the local engine.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import subprocess
from pathlib import Path

import redis

from contract import db, signing, valkey_auth
from contract.signing import RunKeys
from dispatcher.backends import daemons, resources
from dispatcher.backends.base import Backend
from dispatcher.backends.local_services import LocalServices
from dispatcher.backends.resources import RunResources


def _json_line(row: dict) -> str:
    return json.dumps(row, default=str) + "\n"


def simulator_args(plan, run_dir: Path) -> list[str]:
    """The provider simulator's command line for the plan's [simulator] (its dataset: the plan's instances)."""
    sim = plan.spec.simulator
    dataset = run_dir / "instances.jsonl"
    dataset.write_text("".join(_json_line(r) for r in plan.rows.values()))
    argv = ["--dataset", str(dataset), "--policy", sim.policy if sim else "echo"]
    for flag in ("rpm", "tpm", "itpm", "otpm"):
        if sim and getattr(sim, flag):
            argv += [f"--{flag}", str(getattr(sim, flag))]
    if sim and sim.error_rate:
        argv += ["--error-rate", str(sim.error_rate)]
    if sim and sim.error_statuses:
        argv += ["--error-statuses", ",".join(map(str, sim.error_statuses))]
    if sim and sim.seed is not None:
        argv += ["--seed", str(sim.seed)]
    if sim and sim.outage_s:
        argv += ["--outage-s", str(sim.outage_s), "--outage-status", str(sim.outage_status)]
        for flag in ("outage_at_s", "outage_after_calls"):
            if getattr(sim, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(sim, flag))]
    return argv


def run_valkey_user(admin: redis.Redis, valkey_url: str, spec, run_keys: RunKeys) -> dict[str, str]:
    """The run's own Valkey user (its keys and its pool's pacing keys only), created with the admin connection:
    the environment that hands it to tasks. Refuses a server without credentials: there, tasks could write any
    run's keys."""
    if not valkey_auth.has_credentials(valkey_url):
        raise RuntimeError("VALKEY_URL has no credentials: tasks could read and write every run's keys there;"
                           " use the project's own server (scripts/stack.sh up) or one with AUTH")
    password = signing.valkey_password(run_keys.run_secret)
    user = valkey_auth.ensure_run_user(admin, spec.run.name, spec.pool, password)
    return {valkey_auth.USER_ENV: user, valkey_auth.PASSWORD_ENV: password}


class LocalBackend(Backend):
    launchers = ("process", "docker")
    builds_images = True

    def __init__(self, spec):
        super().__init__(spec)
        self.workers: list[subprocess.Popen] = []  # the eval workers this process started
        self.provider_admin: tuple[str, str] | None = None  # (URL, admin key) of the run's ProviderKeys

    @classmethod
    def default_launcher(cls, adapter) -> str:
        # a harness installed only in its task image layer (the npm harnesses) runs in its task image
        return "docker" if adapter.needs_image else "process"

    @functools.cached_property
    def services(self) -> LocalServices:
        return LocalServices(self.run_dir)

    def image_problems(self, plan) -> dict[str, str]:
        """Each instance's image in the local engine (or mirror), or a bundle to build its stand-in from."""
        if not self.in_task_images:
            return {}
        import docker

        from eval_worker.pinning import ImageResolver, ImageUnavailable

        try:
            client = docker.from_env(timeout=30)
            client.ping()
        except Exception as e:  # noqa: BLE001 - no engine at all
            return dict.fromkeys(plan.rows, f"backend.launcher = '{self.spec.backend.launcher}' but no Docker engine answers ({e}); " "scripts/docker.sh up")
        problems = {}
        t = self.image_target()
        for iid, row in plan.rows.items():
            try:
                ImageResolver(db.database_url(), t.instance_registry).resolve(client, row)
            except ImageUnavailable as e:
                if iid not in plan.bundles or t.instance_registry:
                    problems[iid] = f"no image: {e}"
        return problems

    def bucket(self) -> str:
        daemons.ensure_moto()  # the local S3/SQS server, started if it is not running
        return resources.DEFAULT_BUCKET

    def upstream(self, plan) -> tuple[str, str]:
        spec = self.spec
        if spec.model.base_url:
            key = os.environ.get(spec.model.api_key_env, "")
            if not key:
                raise RuntimeError(f"model.api_key_env: environment variable {spec.model.api_key_env} is not set")
            return spec.model.base_url, key
        return self.services.simulator(simulator_args(plan, self.run_dir), "sk-sim-" + secrets.token_hex(16))

    def open_gateway(self, plan, conn, valkey_url: str, run_keys: RunKeys, upstream: str, provider_key: str):
        """The local tier (LiteLLM replicas behind haproxy, daemons of the state folder); the provider key (the
        run's own, minted with the run's cap as its limit, where the provider has ProviderKeys) goes to its 0600 key
        file. A run whose provider is its own simulator gets an alias of its own (its simulator's URL is the run's
        alone); a real provider's pool is one alias for every run on it."""
        from dispatcher.provider_keys import lifecycle
        from gateway import keyfile, runs, tier

        spec = self.spec
        info = daemons.ensure_gateway(valkey_url, spec.gateway.replicas)
        key_file = tier.provider_keys_file(daemons.state_dir())
        provider = spec.provider_keys
        name, key = runs.key_name(provider_key), provider_key
        if provider is not None:
            self.provider_admin = (upstream, provider_key)  # the account's key: it mints, reads and revokes
            name, key = lifecycle.open_key(conn, provider, upstream, provider_key, spec.run.name,
                                           spec.budget.run_usd, runs.key_name)
        if key is not None:
            keyfile.put(key_file, name, key)
        alias = spec.pool if spec.model.base_url else f"{spec.pool}/{spec.run.name}"
        return runs.open_run(conn, redis.Redis.from_url(valkey_url), spec, run_keys.run_secret, info.url, alias,
                             [runs.deployment(spec.model.provider, spec.model.model, upstream, name)],
                             budget_usd=None if provider is not None else spec.budget.run_usd)

    def task_valkey_user(self, admin: redis.Redis, valkey_url: str, run_keys: RunKeys) -> dict[str, str]:
        return run_valkey_user(admin, valkey_url, self.spec, run_keys)

    def start_eval_workers(self, res: RunResources, run_keys: RunKeys) -> None:
        from dispatcher.launchers.process import local_task_env
        from eval_worker import package_index
        from eval_worker.graders import GRADERS

        spec = self.spec
        env = local_task_env({**self.aws_env(), "EVALPLANE_STATE_DIR": str(daemons.state_dir()),
                              "DATABASE_URL": db.database_url(), signing.VERDICT_KEY_ENV: run_keys.verdict_key.decode()})
        if GRADERS.get(spec.eval.backend).uses_package_index:  # the one thing its gradings may reach
            env[package_index.PACKAGE_INDEX_ENV] = daemons.ensure_package_index()
        self.workers = self.services.eval_workers(spec.eval.workers, [
            "--queue", res.eval_queue_url, "--logs-root", str(self.run_dir / "eval"), "--backend", spec.eval.backend],
            env)

    def check_eval_workers(self) -> None:
        for w in self.workers:
            if w.poll() is not None:
                raise RuntimeError(f"an eval worker exited with code {w.returncode}; see {self.run_dir}")

    def stop_eval_workers(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                w.terminate()

    def close_gateway(self, conn, valkey: redis.Redis) -> None:
        from dispatcher.provider_keys import lifecycle

        super().close_gateway(conn, valkey)
        if self.provider_admin is not None:  # before finish(), which stops the simulator
            lifecycle.close_key(conn, *self.provider_admin, self.spec.run.name)

    def finish(self, admin: redis.Redis) -> None:
        self.services.stop_all()  # the simulator and eval workers, this dispatcher's and earlier ones'
        valkey_auth.remove_run_user(admin, self.spec.run.name)
