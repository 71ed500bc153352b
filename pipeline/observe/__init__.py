"""Observability: spans and metrics of every process, the cross-process profile, Prometheus,
TensorBoard, the run report.
"""
