"""The model's one error a user can fix: a scenario, trace or flag it cannot evaluate (a policy
without the clusters it needs, a threshold range that is empty, a length that is no count). A
ValueError too, for the callers that note such a scenario and go on (sweep, crosscheck)."""

from __future__ import annotations

from testbed.core.errors import UserError


class ModelError(UserError, ValueError):
    """The message names the scenario, field or flag."""
