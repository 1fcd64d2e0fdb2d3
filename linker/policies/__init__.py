"""Token-selection policies, one per file (linker). `get_policy(name)` builds one by name."""

from mpic.linker.policies.base import Policy
from mpic.linker.policies.registry import POLICY_NAMES, get_policy, policy_names

__all__ = ["POLICY_NAMES", "Policy", "get_policy", "policy_names"]
