"""LoRA adapters: read as checkpoints (``adapter``), written from a merge (``export``).

Kept import-free: ``maec_core.io.folder`` imports ``adapter`` in the API process, which
must not import torch (``export`` does).
"""
