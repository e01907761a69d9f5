"""Control plane: the DHT, signed records, membership and election."""

from p2ptrain.swarm import hivemind_package

hivemind_package.install()
