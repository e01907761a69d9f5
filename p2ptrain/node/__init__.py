"""The node agent process (one per machine): identity, DHT, heartbeats, election, all-reduce,
checkpoint sidecar, recovery, and the trainer ranks it starts and watches (those run train/).

One outer step N, from the agent's side (rank 0's side is the channel's table, channel.py):

    when                         where                              what
    rank 0 sends Ready(N)        agent.py `_answer`                 off the swarm's track? replay
                                                                    step N from a peer's result, or
                                                                    recover its checkpoint
                                 swarm_link.py `average`            the run's settings still match
    ready                        outer_sync.py `_announce`          signed READY(N) record: stored in
                                                                    the DHT and pushed to the peers'
                                                                    data ports (comm/net/record_push)
    election                     outer_sync.py `_attempts`          swarm/election.py `elect` over
                                 election_reads.py                  the records as they change; who
                                                                    is left out: swarm/evidence.py
    all-reduce                   comm/reduce/allreduce.py           the ring or the butterfly; a
                                                                    failure names whom it can and
                                                                    the survivors elect again
    result                       swarm_link.py                      kept for replay (ckpt/replay.py);
                                                                    Averaged(N) to rank 0
    rank 0 sends StepDone(N)     agent.py                           heartbeat with S's hash; a
                                                                    checkpoint copied off RAM in the
                                                                    background (checkpoint_copies.py)

Modules:

    agent.py               a training node: starts the ranks, answers Ready(N), recovers, lingers
    swarm_link.py          what a training node needs of the network (SoloSwarm without one)
    outer_sync.py          one outer step: ready → election → all-reduce, retried with survivors
    election_reads.py      the records an election reads: DHT reads and records pushed to us
    record_extras.py       what a ready record says beyond its fields (slow links, evidence)
    reachability.py        the address a node announces, and whether others can dial it
    data_server.py         the node's data-plane server, built from its config
    checkpoint_copies.py   staged checkpoints copied to disk and a remote; leftovers of a crash
    config_check.py        refusing a run whose members mostly use other settings
    loneliness.py          a node that trains alone in a networked run says so
    progress.py            what a training node prints
    rank_launcher.py       the trainer ranks: started torchrun-style, watched, stopped by PID
    rank_memory.py         each rank's memory, to tell the OOM killer from a plain kill
    failures.py            how a node ends when it cannot go on: one line each
    interrupt.py           waiting on work the node may have to abandon (a signal, a dead rank)
    startup.py             the node's keys and DHT handle
    drill.py               `p2ptrain drill`: outer steps of synthetic vectors, no model
    observer.py            `p2ptrain watch`: a node that trains nothing
"""
