"""Data plane: direct, authenticated TCP between the members of an outer step, and the all-reduce
over it. Sub-packages by layer, each importing only those above it in this list:

    transport/   frames on one connection: framing (wire), sealing (seal), the handshake that
                 authenticates both ends (handshake), blocking frame I/O on raw sockets (lanes)
    codec/       what a frame's payload holds: blockwise int8/4-bit codes (quant), the sparse
                 error-feedback codes (sparse), each with a NumPy oracle of its kernels
    net/         a node's data port: the listening server (server), its budgets against floods
                 (budget), an attempt's registration and error (attempt), the members of a step
                 (members), dial-back probes (reach), relays for members behind NAT (relay,
                 relay_service), records pushed beside the DHT (record_push)
    robust/      robust aggregation every member can check: clipping arithmetic (clipping), signed
                 claims and results (claims), the owner's and checker's part in a step (aggregator)
    reduce/      one all-reduce (allreduce: the ring, the butterfly or the sparse gather): who
                 sends what (schedule), one member's part (plan; gather for the sparse codec),
                 dialing every lane (connect), the threads that move frames (transfer), the
                 completion barrier (barrier)
"""
