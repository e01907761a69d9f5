"""How a training node ends when it cannot go on: each a one-line error and exit status 1."""

from __future__ import annotations

from p2ptrain.errors import UserError


class TrainingFailed(UserError):
    """A trainer rank died, the agent lost its channel to rank 0, or the node cannot catch up."""

    exit_code = 1


class Diverged(TrainingFailed):
    """The node's params are not the swarm's, and no live member can bring it back on track."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"diverged from the swarm at outer step {step}: {reason}")
