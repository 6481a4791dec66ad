"""An agent that raises in the middle of its episode: the experiment tests' crashing cell.

Imported by name (``agent: "crash_agent:CrashingAgent"``), also inside Ray workers (the test puts this folder on
PYTHONPATH before the cluster starts).
"""

from __future__ import annotations

from typing import Any

from agents.fixed import BaselineAgent


class CrashingAgent(BaselineAgent):
    """Acts like the baseline for ``after`` steps, then raises RuntimeError."""

    name = "crashing"

    def __init__(self, after: int = 2) -> None:
        super().__init__()
        self.after = after
        self.steps = 0

    def act(self, observation: Any, info: Any) -> Any:
        self.steps += 1
        if self.steps > self.after:
            raise RuntimeError(f"deliberate crash at step {self.steps}")
        return super().act(observation, info)
