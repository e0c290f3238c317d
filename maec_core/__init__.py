"""maec_core: the merge library (streaming safetensors engine, merge methods, MAEC).

Pure library: no FastAPI, Celery, Redis or boto3 here. Modules that the HTTP process
imports (errors, recipe, io.headers, io.folder, plan) import no torch.
"""

__version__ = "0.1.0"
