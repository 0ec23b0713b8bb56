"""Compatibility with Keras and TensorFlow: private names, and patches of upstream bugs.

Everything tf_adacomp does to the frameworks beyond their public API is here, each with
its guard beside it and a canary test in ``tests/compat/`` that exercises the installed
framework:

- ``versions``: the versions the guards were checked against, and the installed ones;
- ``internals``: accessors of the private Keras and TensorFlow names the package reads
  or sets, and the list of those used in place elsewhere;
- ``patches``: the one mechanism through which every attribute of Keras or TensorFlow
  that the package replaces is replaced: of a class or module (``install``, ``revert``,
  ``applied``), for a while (``patched``), or of one object (``patch_instance``,
  ``unpatch_instance``); its docstring lists every patch, its kind, when it is
  installed and its canary. Importing ``tf_adacomp`` installs only the two that must be
  (``MirroredStrategy._collective_key_base``: see
  ``internals.own_collective_keys_per_strategy``);
- ``keras_multi_worker``: the fix that makes Keras 3 ``model.fit`` train under
  multi-worker ``MultiWorkerMirroredStrategy``;
- ``loss_scale``: the fix that makes ``LossScaleOptimizer(CompressedOptimizer(...))``
  take one finiteness decision for all replicas.

Users need none of it: ``CompressedOptimizer`` and
``tf_adacomp.distribute.multi_worker_strategy()`` apply the fixes they need.
"""
