"""Robust aggregation: one member's update counts as at most a few typical ones, checked by all.

clipping.py    the arithmetic: norms, per-member limits, the clipped sum
claims.py      signed norm claims and signed chunk results (`Ledger`)
aggregator.py  a member's part in one robust all-reduce: clip and sign as owner, check as member
"""
