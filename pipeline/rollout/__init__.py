"""Rollouts: episodes against environments, the producer that runs many at once and admits
them, held-out evaluation.
"""
