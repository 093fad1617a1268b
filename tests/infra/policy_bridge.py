"""Run the CrossGuard policies over what the Pulumi mocks recorded (no CLI, no PolicyPack)."""

from __future__ import annotations

from typing import Any

from pulumi_policy import (
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    StackValidationArgs,
)


def _opts() -> PolicyResourceOptions:
    return PolicyResourceOptions(
        protect=False, ignore_changes=[], delete_before_replace=None, aliases=[], custom_timeouts=None,
        additional_secret_outputs=[], parent=None,
    )


def _refs(value: Any, ids: dict[str, Any]) -> list[Any]:
    if isinstance(value, str):
        return [ids[value]] if value in ids else []
    if isinstance(value, dict):
        return [x for v in value.values() for x in _refs(v, ids)]
    if isinstance(value, list):
        return [x for v in value for x in _refs(v, ids)]
    return []


def resource_args(r) -> ResourceValidationArgs:
    return ResourceValidationArgs(r.typ, r.inputs, r.urn or f"urn:{r.name}", r.name, _opts(), None)


def stack_resources(records) -> list[PolicyResource]:
    """PolicyResources with props = recorded outputs and dependencies found by id, like the engine's graph."""
    customs = [r for r in records if r.custom]
    prs = {
        r.id: PolicyResource(r.typ, dict(r.outputs, id=r.id), r.urn or f"urn:{r.name}", r.name, _opts(), None, None, [], {})
        for r in customs
    }
    for r in customs:
        pr = prs[r.id]
        for key, value in r.inputs.items():
            deps = [d for d in _refs(value, prs) if d is not pr]
            if deps:
                pr.property_dependencies[key] = deps
                pr.dependencies.extend(d for d in deps if d not in pr.dependencies)
    return list(prs.values())


def run_resource_policies(policies, records) -> list[tuple[str, str, str]]:
    violations: list[tuple[str, str, str]] = []
    for r in records:
        if not r.custom:
            continue
        for pol in policies:
            pol.validate(resource_args(r), lambda msg, urn=None, _p=pol, _r=r: violations.append((_p.name, _r.name, msg)))
    return violations


def run_stack_policies(policies, records) -> list[tuple[str, str | None, str]]:
    violations: list[tuple[str, str | None, str]] = []
    args = StackValidationArgs(stack_resources(records))
    for pol in policies:
        pol.validate(args, lambda msg, urn=None, _p=pol: violations.append((_p.name, urn, msg)))
    return violations
