"""The record format: trajectories in Python, their Avro encoding and schemas, the ledger of
what each step trained.
"""
