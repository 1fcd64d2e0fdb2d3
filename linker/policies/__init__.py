"""Token-selection policies, one file each on one small base class (see base.py)."""
