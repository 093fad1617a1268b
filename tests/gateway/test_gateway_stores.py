"""Where a replica finds the provider key a deployment names (gateway/keyfile.py's stores, by name), and the settings
a replica reads from its environment (an estate's users come apart from the URLs)."""

from __future__ import annotations

import os
import stat

import pytest

from gateway import keyfile
from gateway.config import GatewaySettings
from plumbing.registry import UnknownName


def _settings(**kw) -> GatewaySettings:
    return GatewaySettings(database_url="postgresql://db/x", valkey_url="redis://v:6379/0", **kw)


def test_the_file_store_is_the_local_tiers_key_file(tmp_path):
    f = tmp_path / "gw" / "provider-keys.json"
    store = keyfile.store(_settings(provider_keys_file=f))
    assert isinstance(store, keyfile.FileStore) and store.get("a") is None
    store.put("a", "sk-a")
    keyfile.put(f, "b", "sk-b")  # what the local dispatcher writes, the store reads
    assert (store.get("a"), store.get("b")) == ("sk-a", "sk-b")
    store.delete("a")
    assert keyfile.read(f) == {"b": "sk-b"} and stat.S_IMODE(f.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="provider_keys_file"):
        keyfile.store(_settings()).get("a")


def test_a_store_is_chosen_by_name():
    with pytest.raises(UnknownName, match="nowhere"):
        keyfile.store(_settings(provider_keys_store="nowhere"))
    with pytest.raises(ValueError, match="provider_keys_prefix"):
        keyfile.store(_settings(provider_keys_store="secretsmanager")).secret_id("k")


def test_the_secretsmanager_store_one_secret_per_key(moto_endpoint, unique):
    import boto3

    store = keyfile.store(_settings(provider_keys_store="secretsmanager", provider_keys_prefix=f"{unique}/pk/"))
    assert store.get("key-1") is None
    store.put("key-1", "sk-one")
    store.put("key-1", "sk-one-again")  # a resumed run's key replaces its earlier one
    assert store.get("key-1") == "sk-one-again"
    assert boto3.client("secretsmanager").get_secret_value(SecretId=f"{unique}/pk/key-1")["SecretString"] == \
        "sk-one-again"
    store.delete("key-1")
    store.delete("key-1")  # a second close of the run
    assert store.get("key-1") is None


def test_a_replica_puts_its_users_into_the_urls(monkeypatch):
    env = {"GATEWAY_DATABASE_URL": "postgresql://aurora:5432/evalplane?sslmode=require",
           "GATEWAY_VALKEY_URL": "rediss://valkey:6379/0", "GATEWAY_DATABASE_USER": "evalplane_gateway",
           "GATEWAY_DATABASE_PASSWORD": "p/w", "GATEWAY_VALKEY_USER": "evalplane-gateway",
           "GATEWAY_VALKEY_PASSWORD": "vpw", "GATEWAY_PROVIDER_KEYS_STORE": "secretsmanager",
           "GATEWAY_PROVIDER_KEYS_PREFIX": "evalplane/gateway/provider-keys/"}
    for k in list(os.environ):
        if k.startswith(("GATEWAY_", "EVALPLANE_VALKEY_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = GatewaySettings.from_env()
    assert s.database_url == "postgresql://evalplane_gateway:p%2Fw@aurora:5432/evalplane?sslmode=require"
    assert s.valkey_url == "rediss://evalplane-gateway:vpw@valkey:6379/0"
    assert (s.provider_keys_store, s.provider_keys_prefix, s.provider_keys_file) == (
        "secretsmanager", "evalplane/gateway/provider-keys/", None)
    # the local tier's replicas: URLs with their credentials already, a key file, and never a task's Valkey user
    monkeypatch.setenv("EVALPLANE_VALKEY_PASSWORD", "a-task-password")
    for k in ("GATEWAY_DATABASE_USER", "GATEWAY_DATABASE_PASSWORD", "GATEWAY_VALKEY_USER", "GATEWAY_VALKEY_PASSWORD",
              "GATEWAY_PROVIDER_KEYS_STORE", "GATEWAY_PROVIDER_KEYS_PREFIX"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("GATEWAY_DATABASE_URL", "postgresql://u:pw@127.0.0.1:5432/test")
    monkeypatch.setenv("GATEWAY_PROVIDER_KEYS_FILE", "/state/gateway/provider-keys.json")
    s = GatewaySettings.from_env()
    assert s.database_url == "postgresql://u:pw@127.0.0.1:5432/test" and s.valkey_url == "rediss://valkey:6379/0"
    assert s.provider_keys_store == "file" and str(s.provider_keys_file) == "/state/gateway/provider-keys.json"
    assert GatewaySettings(**s.model_dump()).env()["GATEWAY_PROVIDER_KEYS_FILE"] == str(s.provider_keys_file)
