"""The gateway tier: LiteLLM proxy replicas, DB-less, with this package as their plugin code.

LiteLLM's database mode needs Prisma engines fetched at start-up from a host these machines cannot reach, so the
replicas run without LiteLLM's database and the control plane keeps what LiteLLM would: keys (keys.py, checked by
auth.py, LiteLLM's documented `custom_auth` hook), aliases and their deployments (aliases.py, loaded into each
replica's router on first use), and the meter (meter.py, a LiteLLM custom logger writing one row per call to
PostgreSQL). Every replica reads the same PostgreSQL and Valkey, so any replica serves any call.
`config.py` renders the one LiteLLM configuration; `tier.py` runs replicas behind haproxy on this host.
"""
