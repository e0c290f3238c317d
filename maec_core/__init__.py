"""maec_core: the merge library (streaming safetensors engine, merge methods, MAEC).

Pure library: no FastAPI, Celery, Redis or boto3 here. The service enters through
:mod:`maec_core.service` (torch-free, what the HTTP process imports) and
:mod:`maec_core.service.running` (what merges; the worker's). The folders are floors:
what runs recipes sits above the recipe model (:mod:`maec_core.recipe`), which sits above
file I/O and the errors (the ``core-floors`` import contract).
"""

__version__ = "0.1.0"
