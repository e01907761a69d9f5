"""A trainer rank process (one per GPU): model, data, the FSDP2 inner loop, the DiLoCo outer step
and the checkpoint writer. It talks to its node agent only through p2ptrain/channel.py."""
