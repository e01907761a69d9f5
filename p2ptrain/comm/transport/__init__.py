"""Frames on one data-plane connection.

wire.py       a frame: fixed prefix, small msgpack header, raw payload; bounded reads
seal.py       every frame after the handshake encrypted and authenticated (AEAD)
handshake.py  mutual authentication of two members of one step, and the session keys
lanes.py      blocking frame I/O on the raw sockets the all-reduce's threads use
resume.py     a lane kept after its step, re-bound to the next in one round trip
pacing.py     a declared uplink (comm.uplink_mbit) split among the lanes by the kernel's pacing caps
"""
