"""Coordinator side: strategies, aggregation, checkpoints, the coordinator service."""
