"""Training: the trainer loop and its durability order, intake of records, the training
contract, batching, the loss.
"""
