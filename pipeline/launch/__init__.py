"""Launching: the whole pipeline as supervised processes on one machine, the local cluster,
stop signals, the round-trip check.
"""
