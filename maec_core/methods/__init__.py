"""Merge methods: torch-free specs (``specs``) and tensor implementations (``registry``)."""
