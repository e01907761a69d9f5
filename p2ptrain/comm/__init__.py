"""Data plane: int8 codes, wire framing and the ring all-reduce."""
