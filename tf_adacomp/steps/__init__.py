"""The optimizer wrappers' steps: one guarded step, and each exchange mode a small
module composed on it.

- ``guard``: the guarded step written once: every replica agrees whether its values are
  finite, the compressed exchange, the residues kept only where the result is finite
  (the one residue owner), the bytes counted, the step applied on every replica's copy.
- ``inner``: how a mode reaches the inner optimizer (one adapter per wrapper: Keras 3's
  and tf_keras').
- The modes, each a callable ``step(grads, variables, indices, dense)`` made by the
  wrapper's ``build``: ``gradients.GradientExchange``, ``updates.UpdateExchange``
  (with ``momentum_masking`` and the outer optimizer), ``local_rounds.LocalRounds``,
  ``shared_adam.SharedMoment``.
- ``arguments``: the Keras 3 wrapper's arguments checked and resolved, each mode's own
  checks in its module.

A new exchange mode is a new module here with a class of that call, its argument checks
beside it (called from ``arguments``), chosen and made by the wrapper's ``_make_step``.
A feature that follows any step wraps it (``ema.AfterExchange``) rather than branching
inside one.
"""
