"""Parameter sweeps: one recipe, a grid of numeric knobs, every candidate evaluated.

Torch-free modules: :mod:`~maec_core.sweep.spec` (the ``sweep:`` block of a recipe or
job), :mod:`~maec_core.sweep.grid` (candidates as concrete recipes, checked without
reading any weight), :mod:`~maec_core.sweep.board` (the leaderboard and the winner).
The torch side is :mod:`~maec_core.sweep.runner` (``run_sweep``) and
:mod:`~maec_core.sweep.evaluation` (evaluation attached to a published folder). This
package's own import loads none of them, so ``maec_core.recipe`` can use the spec.
"""
