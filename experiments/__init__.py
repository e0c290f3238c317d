"""experiments: the small-scale transfer experiment (docs/experiments.md).
"""
