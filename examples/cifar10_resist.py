"""CIFAR-10 with ResIST (Dun et al., UAI 2022): a pre-activation ResNet cut into sub-ResNets.

Every round, the residual blocks that are not the first of their stage are dealt out
among the replicas; each replica trains its sub-ResNet on its own data for
``--local_steps`` SGD steps, then every parameter becomes its average over the replicas
that held it (``tf_adacomp.resist``; docs/resist.md). ``--method`` trains the same model
with local SGD (every replica the whole network, averaged every ``--local_steps`` steps)
or data-parallel SGD (a gradient all-reduce every step) instead, for comparison; the
summary gives the bytes one replica sends per round of ``--local_steps`` steps for all
three. Data as ``cifar10_resnet`` (its ``--dataset`` and ``--depth``): tfds ``cifar10``, or
``--dataset=fashion_mnist``, offline, padded to 32x32x3.

    python -m tf_adacomp.examples.cifar10_resist --replicas=4 --depth=20 --local_steps=50
    python -m tf_adacomp.examples.cifar10_resist --dataset=fashion_mnist --method=local_sgd
"""

import sys

from absl import app
from absl import flags

from tf_adacomp.examples import cifar10_resnet  # the data, --depth and --dataset
from tf_adacomp.examples import distribution
from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import training
from tf_adacomp.ops import checks

flags.adopt_module_key_flags(flags_and_config)  # --help lists the shared flags too
flags.adopt_module_key_flags(cifar10_resnet)

NAME = "cifar10_resist"
# Dun et al. train ResNets on CIFAR-10 with SGD (momentum 0.9), 0.1 and step decay.
DEFAULTS = dict(epochs=160, batch_size=128, learning_rate=0.1, lr_schedule="step",
                compressor="none")
OPTIONS = dict(depth=20, dataset="cifar10", width=16, method="resist", local_steps=50,
               min_blocks=0)
METHODS = ("resist", "local_sgd", "data_parallel")

flags.DEFINE_enum("method", None, METHODS,
                  "resist: sub-ResNets, averaged over their holders every --local_steps; "
                  "local_sgd: whole networks, averaged every --local_steps; data_parallel: "
                  "a gradient all-reduce every step.")
flags.DEFINE_integer("local_steps", None, "SGD steps of a ResIST / local SGD round (50).",
                     lower_bound=1)
flags.DEFINE_integer("min_blocks", None, "Minimum partitionable blocks of a sub-ResNet (0).",
                     lower_bound=0)
flags.DEFINE_integer("width", None, "Filters of the first stage (16; then 2x, 4x).",
                     lower_bound=1)


def _options(config):
  """The example's own settings, checked; ValueError names the first one out of range."""
  options = config.options
  if options["method"] not in METHODS:
    raise ValueError(f"`method` must be one of {METHODS}. Received: method={options['method']!r}")
  for name, minimum in (("local_steps", 1), ("min_blocks", 0), ("width", 1)):
    checks.int_at_least(options[name], name, minimum, word="int")
  if options["method"] != "data_parallel":
    for name, plain in (("compressor", "none"), ("reduction", "sum")):
      if getattr(config, name) != plain:
        raise ValueError(f"`{name}` must be {plain!r} with method={options['method']!r}: "
                         f"its replicas exchange weights, not gradients. "
                         f"Received: {name}={getattr(config, name)!r}")
  return options


load_data = cifar10_resnet.load_data


def build_model(config, data):
  del data
  from tf_adacomp import resist

  options = _options(config)
  return resist.resnet(int(options["depth"]), width=options["width"])


def callbacks(config):
  """ResIST or local SGD rounds; data-parallel: only the bytes accounting."""
  import keras
  from tf_adacomp import resist

  options = _options(config)

  def references(model):  # on the same model: ResIST (expected), local SGD, data-parallel
    return resist.communication(model, model.distribute_strategy.num_replicas_in_sync,
                                options["local_steps"], options["min_blocks"], config.seed)

  class DataParallel(keras.callbacks.Callback):
    def summary(self):
      figures = references(self.model)
      return {"method": "data_parallel",
              "bytes_per_round": figures["data_parallel_bytes_per_round"], "resist": figures}

  class Rounds(resist.ResIST):
    def on_train_end(self, logs=None):
      super().on_train_end(logs)
      if config.verbose and distribution.is_chief(self.model.distribute_strategy):
        print(format_communication(self.communication()), flush=True)

    def summary(self):
      measured = self.communication()
      per_step = measured["bytes_per_round"] / self.local_steps
      dense = measured["data_parallel_bytes_per_step"]
      total = {"dense_bytes_per_step": dense, "sent_bytes_per_step": per_step,
               "ratio": dense / per_step}
      return {"method": measured["method"], "bytes_per_round": measured["bytes_per_round"],
              "bytes_sent_per_step": per_step, "compression_ratio": total["ratio"],
              "compression": {"total": total},
              "resist": {**references(self.model), **measured}}

  if options["method"] == "data_parallel":
    return [DataParallel()]
  return [Rounds(local_steps=options["local_steps"], min_blocks=options["min_blocks"],
                 seed=config.seed, partition=options["method"] == "resist")]


def format_communication(measured):
  """One line per method: bytes one replica sends per round of ``local_steps`` steps."""
  steps = measured["local_steps"]
  lines = [f"{measured['method']}: {measured['rounds']} rounds of {steps} steps, "
           f"{measured['replicas']} replicas; bytes one replica sends per round:",
           f"  {measured['method']:<14} {measured['bytes_per_round']:>14,.0f}"
           f"  (padded to the longest replica: {measured['padded_bytes_per_round']:,.0f})",
           f"  {'local SGD':<14} {measured['local_sgd_bytes_per_round']:>14,.0f}",
           f"  {'data-parallel':<14} {measured['data_parallel_bytes_per_round']:>14,.0f}"
           f"  ({steps} x {measured['data_parallel_bytes_per_step']:,.0f})"]
  return "\n".join(lines)


def main(argv):
  training.run(sys.modules[__name__], argv)


if __name__ == "__main__":
  app.run(main)
