"""Partition quality: the paper's greedy against the exact min-max split on BERT-base and ViT-B/16.

Run from the repository root: ``python -m benchmarks.partition_quality`` (see README.md).
"""
