"""Keep p2ptrain's log the only voice: hivemind logs every retry at INFO/WARNING with its own handler.

Imported by every swarm module that imports hivemind (and so before any DHT starts), rather than by
the command line up front: commands that never touch the swarm (`config`, `export`, training alone,
a `join` refused for its arguments) then do not pay the ~4 s that importing hivemind costs.
"""

from __future__ import annotations

import logging

from hivemind.utils.logging import use_hivemind_log_handler

# hivemind's records go to our handlers, in our format, and only its errors
use_hivemind_log_handler("nowhere")
logging.getLogger("hivemind").setLevel(max(logging.getLogger().getEffectiveLevel(), logging.ERROR))
