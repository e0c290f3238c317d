"""Parameter sweeps: one recipe, a grid of numeric knobs, every candidate evaluated.

The ``sweep:`` block itself is part of the recipe model (:mod:`maec_core.recipe.sweep`).
Torch-free modules: :mod:`~maec_core.sweep.grid` (candidates as concrete recipes, checked without
reading any weight), :mod:`~maec_core.sweep.inputs` (eval set sources, the inputs a
sweep compares against), :mod:`~maec_core.sweep.board` (the leaderboard and the winner),
:mod:`~maec_core.sweep.attach` (evaluation files added to a published folder, manifest
kept true). The torch side: :mod:`~maec_core.sweep.runner` (``run_sweep``,
``evaluate_folder``), :mod:`~maec_core.sweep.scoring` and :mod:`~maec_core.sweep.memory`
(inputs held in memory for all candidates); :mod:`~maec_core.sweep.plot`
draws ``sweep.png`` (matplotlib); :mod:`~maec_core.sweep.cli` is ``maec sweep``. This
package's own import loads none of them.
"""
