"""Control plane: the DHT, signed records, membership and election.

A node's record moves through these states (records.py `NodeState`); the election of step N reads
every record of the run and decides alike on every node, without a leader:

    state        the node is …                      the election of step N …
    joining      fetching the swarm's checkpoint     not a member yet (it joins a later step)
    training     in the inner phase of its step      waits for it (at step N) until the deadline
    ready        done with step N, Δ handed over     takes it as a member (weight: its tokens)
    syncing      in the all-reduce of step N         takes it (it is in an attempt of N)
    finished     done with the run, still serving    counts it past N (it takes no more steps)
    leaving/dead gone (the deathrattle)              leaves it out at once
    relay        a standby relay, trains nothing     lists it for edges between NAT'd members

Members: the ready nodes, once every node expected at N is ready or the straggler deadline
passed with a majority ready (election.py `decide`); never alone while another live node is at or
past N; left out, by the same rule everywhere, whoever the signed evidence of failed attempts
names (evidence.py); ring order from the step and the measured links (`ring_order`).

Modules:

    dht.py / dht_process.py   the hivemind DHT node, in a forked child, with bounded calls
    records.py                heartbeat records: format, signatures, tickets
    validator.py              the DHT validator that enforces records.py on every store
    membership.py             publishing this node's record; reading and judging everyone's
    election.py               the members and ring order of one step
    evidence.py               who is left out of a step, from signed reports of failed attempts
    crash_watch.py            crashed nodes noticed in about a second (their port refuses)
    start_quorum.py           `swarm.wait_nodes`: when a run starts
    roster.py                 who joined and who left, and why: the lines nodes and bootstraps print
    status.py                 the swarm table (`p2ptrain status`, the logs)
    admission.py              tickets for closed runs
    standby.py                standby relays run by bootstrap peers
    bootstrap.py              a bootstrap peer
    maddr.py / p2p_key.py     bootstrap addresses; the DHT's libp2p key
    hivemind_package.py / quiet.py   hivemind without its package __init__s; its logs quiet
"""

from p2ptrain.swarm import hivemind_package

hivemind_package.install()
