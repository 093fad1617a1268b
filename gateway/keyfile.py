"""The gateway's provider keys: a 0600 JSON file {name: key} that only the gateway processes and the operator (the
local dispatcher) read. Deployments name a key; the key itself never leaves this file for a task or the database."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from plumbing.registry import Registry


def read(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def put(path: Path, name: str, key: str) -> None:
    """Add or replace one key (under a lock: two dispatchers may add theirs at once), rewritten atomically 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = read(path)
        if found.get(name) == key:
            return
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(found | {name: key}, f)
        os.replace(tmp, path)


class KeyStore:
    """Where a gateway's provider keys live, by name: the dispatcher puts a run's key, the replicas get the key a
    deployment names (gateway/runtime.py) and nobody else reads them. By name in KEY_STORES."""

    def __init__(self, settings):
        self.settings = settings  # gateway.config.GatewaySettings

    def get(self, name: str) -> str | None:
        raise NotImplementedError

    def put(self, name: str, key: str) -> None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError


class FileStore(KeyStore):
    """The local tier's 0600 file (read and put above)."""

    @property
    def path(self) -> Path:
        if self.settings.provider_keys_file is None:
            raise ValueError("provider_keys_file: the file store needs GATEWAY_PROVIDER_KEYS_FILE")
        return self.settings.provider_keys_file

    def get(self, name: str) -> str | None:
        return read(self.path).get(name)

    def put(self, name: str, key: str) -> None:
        put(self.path, name, key)

    def delete(self, name: str) -> None:
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = read(self.path)
            if found.pop(name, None) is not None:
                tmp = self.path.with_suffix(".tmp")
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                    json.dump(found, f)
                os.replace(tmp, self.path)


class SecretsManagerStore(KeyStore):
    """An estate's Secrets Manager: one secret per key, named provider_keys_prefix + name, which only the gateway's
    task role may read (a replica's environment holds none, so a key put after it started is found too)."""

    def secret_id(self, name: str) -> str:
        if not self.settings.provider_keys_prefix:
            raise ValueError("provider_keys_prefix: the secretsmanager store needs GATEWAY_PROVIDER_KEYS_PREFIX")
        return self.settings.provider_keys_prefix + name

    @staticmethod
    def _client():
        from contract import aws

        return aws.client("secretsmanager")

    def get(self, name: str) -> str | None:
        sm = self._client()
        try:
            return sm.get_secret_value(SecretId=self.secret_id(name))["SecretString"]
        except (sm.exceptions.ResourceNotFoundException, sm.exceptions.InvalidRequestException):
            return None  # never put, its value not set yet, or deleted

    def put(self, name: str, key: str) -> None:
        sm = self._client()
        try:
            sm.create_secret(Name=self.secret_id(name), SecretString=key)
        except sm.exceptions.ResourceExistsException:
            sm.put_secret_value(SecretId=self.secret_id(name), SecretString=key)

    def delete(self, name: str) -> None:
        sm = self._client()
        try:
            sm.delete_secret(SecretId=self.secret_id(name), ForceDeleteWithoutRecovery=True)
        except sm.exceptions.ResourceNotFoundException:
            pass


KEY_STORES: Registry[type[KeyStore]] = Registry("provider key store", base=KeyStore)
KEY_STORES.register("file", "gateway.keyfile:FileStore")
KEY_STORES.register("secretsmanager", "gateway.keyfile:SecretsManagerStore")


def store(settings) -> KeyStore:
    """The store settings.provider_keys_store names."""
    return KEY_STORES.get(settings.provider_keys_store)(settings)
