"""LoRA adapters written from a merge (``export``).

Reading an adapter as a checkpoint is file I/O and sits with it, in
:mod:`maec_core.io.adapter` (torch-free, the API checks adapters with it).
"""
