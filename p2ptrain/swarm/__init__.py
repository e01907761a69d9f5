"""Control plane: the DHT, signed records, membership and election."""

import os

# hivemind shares small tensors with its DHT child; its default strategy ("file_system") starts a
# torch_shm_manager process that outlives each p2ptrain process by seconds. File descriptors (torch's
# own default on Linux) need no helper process. Set before any hivemind module is imported.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

from p2ptrain.swarm import hivemind_package

hivemind_package.install()
