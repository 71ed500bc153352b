"""Benchmarks: `rlstream bench ...`, each printing ratios measured side by side in one run."""
