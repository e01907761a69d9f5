"""Control plane: the DHT, signed records, membership and election."""
