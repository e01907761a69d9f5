"""A node's data port and the connections it takes.

server.py         the listening server: hands each authenticated connection to its step
budget.py         budgets for connections that have not authenticated yet (floods)
attempt.py        one attempt of one step: who may connect, and AllReduceError
warm.py           lanes kept between steps, and the rebinds that come on them
paths.py          round trips and rates measured per peer, and an attempt's deadline from them
members.py        the members of one step, their digest and their shares of the average
reach.py          can others dial this node? dial-back probes
relay.py          edges between two members behind NAT, spliced by a reachable member
relay_service.py  the relay's side of relay.py, in the server
record_push.py    signed records pushed to a step's members beside the DHT
"""
