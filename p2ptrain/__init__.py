"""p2ptrain: peer-to-peer DiLoCo training of language models over a Kademlia DHT."""

__version__ = "0.1.0"
