"""Fashion-MNIST with tf_keras under MultiWorkerMirroredStrategy and AdaComp: a Horovod script migrated.

docs/migration/horovod_keras_fashion_mnist.py converted by the table of
docs/migrating_from_horovod.md; tests/examples/test_horovod_migration.py runs it on 2
worker processes and counts the lines that changed. Each worker runs it with its
TF_CONFIG set (tf_adacomp.distribute.tf_config writes one):

    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}' \
        python tf_keras_fashion_mnist.py CHECKPOINT_DIR
"""

import gzip
import os
import sys

import numpy as np
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras (Keras 2)
import tensorflow as tf
from tf_adacomp import tf_keras as adacomp

DATA_DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
CHECKPOINT_DIR = sys.argv[1] if len(sys.argv) > 1 else "checkpoints"
EPOCHS = int(os.environ.get("EPOCHS", "3"))
STEPS_PER_EPOCH = int(os.environ.get("STEPS_PER_EPOCH", "100"))
BATCH_SIZE = 64  # per worker
BASE_LR = 0.01


def read_idx(name):
  """An IDX file of the Fashion-MNIST distribution as a NumPy array."""
  with gzip.open(os.path.join(DATA_DIR, name)) as f:
    data = f.read()
  dims = data[3]
  shape = np.frombuffer(data, ">i4", dims, 4)
  return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def build_model(learning_rate):
  model = tf.keras.Sequential([
      tf.keras.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
      tf.keras.layers.MaxPooling2D(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(128, activation="relu"),
      tf.keras.layers.Dense(10),
  ])
  # The learning rate is scaled by the number of workers (the schedule below). tf_keras'
  # own SGD, not the legacy one Horovod needed: each replica keeps its own momentum.
  opt = tf.keras.optimizers.SGD(learning_rate, momentum=0.9)
  # The one line of compression: AdaComp instead of Horovod's fp16 allreduce.
  opt = adacomp.CompressedOptimizer(opt)
  model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=opt, metrics=["accuracy"])
  return model


# Memory growth before the strategy, which initialises the GPUs.
gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
  tf.config.experimental.set_memory_growth(gpu, True)
# The cluster comes from TF_CONFIG; the strategy uses all of the worker's GPUs.
strategy = tf.distribute.MultiWorkerMirroredStrategy()

images = read_idx("train-images-idx3-ubyte.gz")[..., None].astype("float32") / 255.0
labels = read_idx("train-labels-idx1-ubyte.gz").astype("int64")
test_images = read_idx("t10k-images-idx3-ubyte.gz")[..., None].astype("float32") / 255.0
test_labels = read_idx("t10k-labels-idx1-ubyte.gz").astype("int64")
dataset = (tf.data.Dataset.from_tensor_slices((images, labels))
           .repeat().shuffle(10000, seed=0).batch(BATCH_SIZE * strategy.num_replicas_in_sync))

# The strategy starts every worker from the chief's weights and averages the epoch's
# metrics (tf_keras sums the per-batch ones over the workers); the learning rate ramps
# up from BASE_LR over the first epoch.
with strategy.scope():
  model = build_model(tf.keras.optimizers.schedules.PolynomialDecay(
      BASE_LR, STEPS_PER_EPOCH, BASE_LR * strategy.num_replicas_in_sync))

# Every worker saves: the chief into CHECKPOINT_DIR, the others into temporary folders.
callbacks = [tf.keras.callbacks.ModelCheckpoint(
    os.path.join(CHECKPOINT_DIR, "checkpoint-{epoch}"), save_weights_only=True)]

model.fit(dataset, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, callbacks=callbacks,
          verbose=2 if strategy.cluster_resolver.task_id == 0 else 0)
loss, accuracy = model.evaluate(test_images, test_labels, batch_size=1000, verbose=0)
if strategy.cluster_resolver.task_id == 0:
  print(f"test accuracy {accuracy:.4f}")
