"""Mixtures of experts assembled from dense fine-tunes (``mergekit-moe`` configs): the
config (``config``, torch-free), the plan from headers (``plan``, ``layout``), router
weights (``gates``) and the streaming builder (``build.build_moe``)."""
