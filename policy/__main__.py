"""evalplane's policy pack: `pulumi preview --policy-pack policy`. The rules live in rules.py."""

import os
import sys

from pulumi_policy import EnforcementLevel, PolicyPack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rules import POLICIES

PolicyPack(name="evalplane-guardrails", enforcement_level=EnforcementLevel.MANDATORY, policies=POLICIES)
