"""What the tests share; none of it is a test.

helpers.py     LocalSwarm (a bootstrap peer and nodes as real processes, stopped by PID),
               `cli`, waiting on external state, one-line-error checks
drills.py      drill nodes' flags and step logs, and the agreement checks
records.py     heartbeat records made up for election and validator tests
ring_procs.py  all-reduce members in processes of their own, and the error budget
fsdp_procs.py  FSDP2 ranks in processes of their own
netlab.py      network namespaces with a NAT router (root, nftables)
internet.py    the internet lab: a namespace per host, joined by router.py (root, /dev/net/tun)
router.py      the lab's userspace router: delay, jitter, loss, rates, queues
                                                              (python -m tests.support.router)
proxy.py       a proxy that flips a bit on the path           (python -m tests.support.proxy)
flooder.py     floods of junk, idle connections and forgeries (python -m tests.support.flooder)
slowloris.py   connections that trickle bytes                 (python -m tests.support.slowloris)
stranger.py    a DHT peer that lies about a run               (python -m tests.support.stranger)
"""
