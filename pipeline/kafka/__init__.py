"""Everything that talks to Kafka: client configs, topics, trajectories in and out, weights
announcements, recordings, and the local broker.
"""
