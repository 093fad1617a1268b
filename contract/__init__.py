"""The contract between the parts: message and row models, Valkey key names, SQL schema, pricing.

Everything that crosses a process boundary (dispatcher -> task -> shim -> writer -> eval worker)
is defined here once, so the parts agree by construction.
"""
