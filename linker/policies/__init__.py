"""Token-selection policies, one per file (linker), their registry and the scout's S tables
(`scout_scales`). `get_policy(name)` builds one by name."""

from mpic.linker.policies.base import Policy
from mpic.linker.policies.registry import POLICY_NAMES, check_depth, get_policy, policy_names

__all__ = ["POLICY_NAMES", "Policy", "check_depth", "get_policy", "policy_names"]
