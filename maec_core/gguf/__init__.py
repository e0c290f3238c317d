"""GGUF in and out: a GGUF file as a merge input (dequantized into a safetensors folder)
and the merged model published as GGUF beside its safetensors.

``names`` and ``sources`` import neither numpy nor ``gguf`` (every ``maec merge`` looks
for GGUF inputs); ``header`` is numpy-only (the API reads a source's header with it);
``dequantize`` and ``writer`` import torch or transformers and belong to the worker and
the command line.
"""
