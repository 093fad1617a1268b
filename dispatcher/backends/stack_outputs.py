"""The Pulumi estate's outputs as the dispatcher reads them: `pulumi stack output --json > stack-outputs.json`.

Only the keys the dispatcher uses are required; the others (operators', the guard's) are kept but not
checked, so the estate can grow outputs without breaking dispatchers. A missing key is named in the error.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError


class StackOutputsError(ValueError):
    """The stack-outputs file is unreadable or lacks keys the dispatcher needs."""


class StackOutputs(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    region: str
    cluster_arn: str
    eval_cluster_arn: str
    harness_subnet_ids: list[str]
    harness_security_group_id: str
    harness_task_definition_arn: str  # the template every task image's revision is derived from
    eval_task_definition_arn: str
    eval_service_name: str
    judge_task_definition_arn: str
    judge_security_group_id: str
    bucket: str
    runs_prefix: str = "runs/"
    queue_prefix: str
    deadline_tag: str = "evalplane:deadline"
    valkey_endpoint: str
    valkey_port: int = 6379
    gateway_url: str
    gateway_cluster_name: str | None = None  # the gateway service a run scales to the replicas its plan sized
    gateway_service_name: str | None = None
    task_images_repository_url: str  # where `python -m dispatcher images` pushes task images (ECR)
    harness_capacity: int | None = None
    # Secrets Manager: the verdict key (eval fleet and writer), the dispatcher's Valkey user ({username, password})
    verdict_key_secret_arn: str | None = None
    valkey_dispatcher_secret_arn: str | None = None

    @property
    def valkey_url(self) -> str:
        """TLS is required on the estate's Valkey (and a user: see dispatcher_valkey_url)."""
        return f"rediss://{self.valkey_endpoint}:{self.valkey_port}/0"

    def required(self, name: str) -> str:
        value = getattr(self, name)
        if not value:
            raise StackOutputsError(f"the stack outputs lack {name}; re-export them from an estate that has it")
        return value

    def dispatcher_valkey_url(self) -> str:
        """valkey_url as the dispatcher's own Valkey user (from its Secrets Manager secret)."""
        from contract import aws, valkey_auth

        secret = json.loads(aws.client("secretsmanager").get_secret_value(
            SecretId=self.required("valkey_dispatcher_secret_arn"))["SecretString"])
        return valkey_auth.with_credentials(self.valkey_url, secret["username"], secret["password"])

    @classmethod
    def load(cls, path: str | Path) -> StackOutputs:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise StackOutputsError(f"cannot read stack outputs {path}: {e}") from e
        if not isinstance(data, dict):
            raise StackOutputsError(f"{path}: expected the JSON object of `pulumi stack output --json`")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            missing = sorted(str(err["loc"][0]) for err in e.errors() if err["type"] == "missing")
            if missing:
                raise StackOutputsError(
                    f"{path} lacks stack output(s) {', '.join(missing)}; re-export with "
                    f"`pulumi stack output --json > {path}` from the estate's stack"
                ) from e
            raise StackOutputsError(f"{path}: {e}") from e
