"""MAEC: extract an ability once as a sparse weight delta, combine it into language bases.

Kept torch-free at package level: the API imports ``maec_core.maec.params`` (and
``maec_core.maec.keys``) to validate recipes, so nothing here may pull in torch. The
torch-using parts are ``extract``, ``combine``, ``gradient`` and ``pipeline``.
"""
