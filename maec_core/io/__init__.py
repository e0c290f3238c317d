"""Checkpoint I/O: header reading (torch-free), lazy tensor reads, streaming writer."""
