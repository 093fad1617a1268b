"""contract.keys (the one definition of the Valkey key names) without importing contract.models.

contract/keys.py imports contract.models for a type annotation only, and contract.models pulls in pydantic
(~13 MB of RSS and ~0.1 s in every shim). Until keys.py imports it under TYPE_CHECKING, it is imported here
with a stand-in `contract.models` module that exists only for the duration of that import. If contract.models
is already loaded (tests, the dispatcher), nothing special happens.
"""

from __future__ import annotations

import sys
import types


def _load():
    if "contract.keys" in sys.modules or "contract.models" in sys.modules:
        from contract import keys

        return keys
    stub = types.ModuleType("contract.models")
    stub.AttemptRef = object  # keys.py uses it only in annotations
    sys.modules["contract.models"] = stub
    try:
        from contract import keys
    finally:
        if sys.modules.get("contract.models") is stub:
            del sys.modules["contract.models"]
    return keys


keys = _load()
