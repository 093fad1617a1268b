"""Least privilege: no role policy has a '*' action, and Resource '*' only for allow-listed actions."""

from __future__ import annotations

import fnmatch
import json

from contract import task_shape
from policy.rules import WILDCARD_ALLOWLIST, iam_violations


def _policies(snapshot):
    return {r.inputs["name"]: json.loads(r.inputs["policy"]) for r in snapshot.of("aws:iam/rolePolicy:RolePolicy")}


def test_every_role_has_exactly_one_reviewed_inline_policy(estate_snapshot):
    roles = estate_snapshot.of("aws:iam/role:Role")
    policies = estate_snapshot.of("aws:iam/rolePolicy:RolePolicy")
    assert sorted(p.inputs["role"] for p in policies) == sorted(r.id for r in roles)
    assert set(_policies(estate_snapshot)) == set(WILDCARD_ALLOWLIST)
    assert not estate_snapshot.of("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
    assert all(not r.inputs.get("managedPolicyArns") for r in roles)


def test_no_wildcard_actions_or_resources_beyond_the_allow_list(estate_snapshot):
    wildcard_uses: dict[str, set[str]] = {}
    for name, doc in _policies(estate_snapshot).items():
        assert iam_violations(name, doc) == [], name
        for st in doc["Statement"]:
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            assert all("*" not in a for a in actions), (name, actions)
            if st["Resource"] == "*" or "*" in st["Resource"]:
                wildcard_uses.setdefault(name, set()).update(actions)
                assert set(actions) <= set(WILDCARD_ALLOWLIST[name]), (name, actions)
    # the allow-list is exactly what is used: no stale entries that would silently widen a tier
    assert {k: set(v) for k, v in WILDCARD_ALLOWLIST.items() if v} == wildcard_uses
    for name, entries in WILDCARD_ALLOWLIST.items():
        for action, (reason, _cond) in entries.items():
            assert reason, (name, action)  # every allowance is documented


def test_run_scoped_grants(estate_snapshot):
    p = _policies(estate_snapshot)
    bucket_arn = "arn:aws:s3:::evalplane-state-artifacts-bucket"

    def resources(name, action):
        return {r for st in p[name]["Statement"] if action in st["Action"] and st["Effect"] == "Allow"
                for r in (st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]])}

    queues = "arn:aws:sqs:us-east-1:123456789012:evalplane-"
    for role in ("harness-task", "eval-task", "judge-task", "dispatcher"):
        assert resources(role, "s3:PutObject") == {f"{bucket_arn}/runs/*"}, role
    # who may send where (tests/infra/test_untrusted.py: the denies, and moto enforcing them)
    assert resources("dispatcher", "sqs:SendMessage") == {queues + "*"}
    assert resources("harness-task", "sqs:SendMessage") == {queues + "ep-*-results"}
    assert resources("eval-task", "sqs:SendMessage") == {queues + "ep-*-verdicts"}
    assert resources("judge-task", "sqs:SendMessage") == set()
    assert resources("harness-task", "elasticache:Connect") == {
        "arn:aws:elasticache:us-east-1:123456789012:replicationgroup/evalplane-state-valkey-phys"
    }
    # dispatcher: RunTask only on our task definition families, PassRole only on the task roles
    assert resources("dispatcher", "ecs:RunTask") == {
        "arn:aws:ecs:us-east-1:123456789012:task-definition/evalplane-harness:*",
        "arn:aws:ecs:us-east-1:123456789012:task-definition/evalplane-judge:*",
    }
    pass_roles = resources("dispatcher", "iam:PassRole")
    assert len(pass_roles) == 4 and all(":role/" in r for r in pass_roles)
    (st,) = [s for s in p["dispatcher"]["Statement"] if "iam:PassRole" in s["Action"]]
    assert st["Condition"] == {"StringEquals": {"iam:PassedToService": "ecs-tasks.amazonaws.com"}}
    assert "ecr:BatchGetImage" in {a for s in p["dispatcher"]["Statement"] for a in s["Action"]}


def test_dispatcher_registers_task_image_revisions_of_the_harness_family_only(estate_snapshot):
    """RegisterTaskDefinition has no resource type: it is narrowed to revisions carrying the harness tier tag (the
    template's tags, which the launcher copies), tagging on creation to the harness family, and passing roles to
    the harness and judge roles only."""
    s = estate_snapshot
    p = _policies(s)
    (reg,) = [st for st in p["dispatcher"]["Statement"] if "ecs:RegisterTaskDefinition" in st["Action"]]
    assert reg["Resource"] == "*" and reg["Condition"] == {
        "StringEquals": {"aws:RequestTag/evalplane:tier": "harness"}}
    harness_td = s.one("aws:ecs/taskDefinition:TaskDefinition", "evalplane-harness-task")
    assert harness_td.inputs["tags"]["evalplane:tier"] == "harness"  # so revisions derived from it may register
    (tag,) = [st for st in p["dispatcher"]["Statement"]
              if "ecs:TagResource" in st["Action"] and "RegisterTaskDefinition" in json.dumps(st.get("Condition"))]
    assert tag["Resource"] == ["arn:aws:ecs:us-east-1:123456789012:task-definition/evalplane-harness:*"]
    (passrole,) = [st for st in p["dispatcher"]["Statement"] if "iam:PassRole" in st["Action"]]
    roles = {r.name: r.outputs["arn"] for r in s.of("aws:iam/role:Role")}
    assert {roles["evalplane-harness-task-role"], roles["evalplane-harness-exec-role"]} <= set(passrole["Resource"])
    assert "ecs:DescribeTaskDefinition" in {a for st in p["dispatcher"]["Statement"] for a in st["Action"]}
    bad = {"Statement": [{"Effect": "Allow", "Action": ["ecs:RegisterTaskDefinition"], "Resource": "*"}]}
    assert iam_violations("dispatcher", bad)  # without the tag condition it is refused


def test_build_tier_pushes_task_images_and_the_instance_mirror(estate_snapshot):
    s = estate_snapshot
    p = _policies(s)
    repos = {r.inputs["name"]: r.outputs["arn"] for r in s.of("aws:ecr/repository:Repository")}
    (push,) = [st for st in p["build-instance"]["Statement"] if "ecr:PutImage" in st["Action"]]
    assert {repos["evalplane/task-images"], repos["evalplane/eval-images"]} <= set(push["Resource"])
    # the build records task-image digests in PostgreSQL: the Aurora secret, and Aurora's port from the build group
    (db_secret,) = [st for st in p["build-instance"]["Statement"] if "secretsmanager:GetSecretValue" in st["Action"]]
    assert db_secret["Resource"] == [s.outputs["aurora_secret_arn"]]
    groups = {r.name: r.id for r in s.of("aws:ec2/securityGroup:SecurityGroup")}
    assert any(r.inputs["securityGroupId"] == groups["evalplane-sg-aurora"]
               and r.inputs.get("referencedSecurityGroupId") == groups["evalplane-sg-build"] and r.inputs["fromPort"] == 5432
               for r in s.of("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"))
    # harness tasks pull their task image, and read their run's key (a secret under <prefix>/runs/, not the judge
    # pass's key beside it) and their Valkey user's secrets, nothing else
    exec_doc = p["harness-exec"]["Statement"]
    (pull,) = [st for st in exec_doc if "ecr:BatchGetImage" in st["Action"]]
    assert pull["Resource"] == [repos["evalplane/task-images"]]
    (secret,) = [st for st in exec_doc if "secretsmanager:GetSecretValue" in st["Action"]]
    valkey_user = s.one("aws:secretsmanager/secret:Secret", "evalplane-state-valkey-harness-secret").outputs["arn"]
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:evalplane/runs/"
    assert secret["Resource"] == [f"{arn}*/{task_shape.RUN_KEY_SECRET}-*", valkey_user]
    assert not fnmatch.fnmatchcase(f"{arn}run-1/{task_shape.JUDGE_KEY_SECRET}-AbCdEf", secret["Resource"][0])
    assert s.outputs["run_secrets_prefix"] == "evalplane/runs/"


def test_iam_violations_catches_bad_documents():
    bad_action = {"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::b/*"}]}
    assert iam_violations("harness-task", bad_action)
    star_resource = {"Statement": [{"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "*"}]}
    assert iam_violations("harness-task", star_resource)
    full_arn_wildcard = {"Statement": [{"Effect": "Allow", "Action": ["sqs:SendMessage"], "Resource": "arn:aws:sqs:*:*:*"}]}
    assert iam_violations("harness-task", full_arn_wildcard)
    not_for_this_tier = {"Statement": [{"Effect": "Allow", "Action": ["ecr:GetAuthorizationToken"], "Resource": "*"}]}
    assert iam_violations("harness-task", not_for_this_tier)
    assert iam_violations("harness-exec", not_for_this_tier) == []
    unconditioned = {"Statement": [{"Effect": "Allow", "Action": ["ecs:ListTasks"], "Resource": "*"}]}
    assert iam_violations("guard", unconditioned)
    assert iam_violations("unknown-role", {"Statement": []})
