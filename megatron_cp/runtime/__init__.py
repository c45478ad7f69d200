"""Runtime: dispatch tokens by a plan and run distributed attention over it."""

from .attention import attention
from .dispatch import dispatch, undispatch

__all__ = ["attention", "dispatch", "undispatch"]
