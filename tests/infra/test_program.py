"""__main__.py, Pulumi.dev.yaml and docs/infra.md stay in step with the components."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pulumi

from components import estate
from components.config import CONFIG_KEYS
from policy import rules as R

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs/infra.md").read_text()


def test_main_exports_every_output(pulumi_mocks, monkeypatch):
    exported: dict = {}
    monkeypatch.setattr(pulumi, "export", lambda k, v: exported.__setitem__(k, v))
    pulumi.runtime.set_all_config({"aws:region": "us-east-1", "evalplane:azCount": "3"})

    @pulumi.runtime.test
    def run():
        runpy.run_path(str(ROOT / "__main__.py"), run_name="__main__")
        return pulumi.Output.from_input(exported)

    run()
    assert set(exported) == set(estate.OUTPUT_KEYS)
    assert len([r for r in pulumi_mocks.mocks.created if not r.custom]) == 11


def test_docs_cover_every_config_key_output_and_policy():
    assert len(CONFIG_KEYS) >= 40
    for key in CONFIG_KEYS:
        assert f"`{key}`" in DOC or f"`{key}` /" in DOC or f"/ `{key}`" in DOC, key
    for key in estate.OUTPUT_KEYS:
        assert f"`{key}`" in DOC, key
    for pol in R.POLICIES:
        assert f"`{pol.name}`" in DOC, pol.name
    for entries in R.WILDCARD_ALLOWLIST.values():
        for action in entries:
            assert f"`{action}`" in DOC, action
    for step in ("pulumi login", "pulumi stack init", "pulumi config set", "pulumi preview --policy-pack policy",
                 "pulumi up", "pulumi stack output --json > stack-outputs.json"):
        assert step in DOC, step


def test_example_stack_config_uses_known_keys():
    text = (ROOT / "Pulumi.dev.yaml").read_text()
    keys = re.findall(r"^\s+evalplane:(\w+):", text, flags=re.MULTILINE)
    assert keys and set(keys) <= set(CONFIG_KEYS)
    assert "aws:region:" in text


def test_policy_pack_main_only_builds_the_pack():
    src = (ROOT / "policy/__main__.py").read_text()
    assert "from rules import POLICIES" in src and src.count("PolicyPack(") == 1
    assert "runtime" in (ROOT / "policy/PulumiPolicy.yaml").read_text()


def _component_classes():
    import ast

    for path in sorted((ROOT / "components").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Attribute) and b.attr == "ComponentResource" for b in node.bases
            ):
                yield path, node


def test_component_discipline_statically():
    """Typed args dataclass, register_outputs last, and no resource constructed inside an apply()."""
    import ast
    import dataclasses
    import importlib

    seen = 0
    for path, cls in _component_classes():
        seen += 1
        init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        last = init.body[-1]
        assert isinstance(last, ast.Expr) and isinstance(last.value, ast.Call), (path.name, cls.name)
        assert last.value.func.attr == "register_outputs", (path.name, cls.name)
        args = next(a for a in init.args.args if a.arg == "args")
        mod = importlib.import_module(f"components.{path.stem}")
        ann = getattr(mod, args.annotation.id)
        assert dataclasses.is_dataclass(ann) and ann.__name__ == f"{cls.name}Args", (cls.name, ann)
        for node in ast.walk(init):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "apply":
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Call):
                        src = ast.unparse(inner.func)
                        assert not src.startswith("aws."), f"{cls.name}: resource {src} inside apply()"
    assert seen == 11
