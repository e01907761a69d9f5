"""One all-reduce of one outer step.

allreduce.py  the entry point `all_reduce`: the ring, the butterfly or the gather, all-or-nothing
schedule.py   who sends which frames to whom, a pure function of (n, length, comm)
plan.py       one member's part: the frames it sends, what it does with those it receives
gather.py     the sparse codec's part: every share to every member, one robust mean everywhere
connect.py    dialing and awaiting every lane of an attempt
transfer.py   the threads that move the frames, and how the event loop waits for them
barrier.py    the completion barrier: a result is taken only once every member holds it
"""
