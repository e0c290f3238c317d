"""bench: benchmarks (`make bench-*`), each printing ratios against a peer measured in
the same run (mergekit, task arithmetic, the I/O floor), and the soak test.
"""
