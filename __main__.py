"""evalplane's AWS estate (Pulumi program). Everything is in components/; see docs/infra.md."""

from components import estate
from components.config import from_pulumi_config

estate.export(estate.build(from_pulumi_config()))
