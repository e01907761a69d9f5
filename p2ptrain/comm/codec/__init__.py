"""What a data frame's payload holds.

quant.py   blockwise 8- or 4-bit codes for fp32 vectors: the compiled kernels and the NumPy
           reference they are tested against
sparse.py  chunk-wise top-k of an error-feedback accumulator at 2 bits a value (comm.codec =
           "sparse"), its kernels' NumPy oracle, and the accumulator itself
"""
