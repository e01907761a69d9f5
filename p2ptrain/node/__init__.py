"""The node agent process (one per machine): identity, DHT, heartbeats, election, all-reduce,
checkpoint sidecar, recovery, and the trainer ranks it starts and watches (those run train/)."""
