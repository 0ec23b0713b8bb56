"""Fashion-MNIST with Horovod and tf.keras, in the shape of a typical Horovod TF2 Keras script.

The starting point of docs/migrating_from_horovod.md: examples/tf_keras_fashion_mnist.py
(tf_keras) and examples/keras3_fashion_mnist.py (Keras 3) are this script converted by
that page's table, and tests/examples/test_horovod_migration.py counts the lines that
changed. It needs Horovod, which does not build against current TensorFlow, so nothing
here runs it. Horovod ran it as:

    horovodrun -np 2 python horovod_keras_fashion_mnist.py CHECKPOINT_DIR
"""

import gzip
import os
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

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
  # Horovod: scale the learning rate by the number of workers.
  opt = tf.keras.optimizers.legacy.SGD(learning_rate, momentum=0.9)
  # Horovod: wrap the optimizer; fp16 compression of the allreduce.
  opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)
  model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=opt, metrics=["accuracy"], experimental_run_tf_function=False)
  return model


# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin one GPU per process.
gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
  tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
  tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

images = read_idx("train-images-idx3-ubyte.gz")[..., None].astype("float32") / 255.0
labels = read_idx("train-labels-idx1-ubyte.gz").astype("int64")
test_images = read_idx("t10k-images-idx3-ubyte.gz")[..., None].astype("float32") / 255.0
test_labels = read_idx("t10k-labels-idx1-ubyte.gz").astype("int64")
dataset = (tf.data.Dataset.from_tensor_slices((images, labels))
           .shard(hvd.size(), hvd.rank())
           .repeat().shuffle(10000, seed=0).batch(BATCH_SIZE))

model = build_model(BASE_LR * hvd.size())

callbacks = [
    # Horovod: start every worker from rank 0's weights.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average the metrics over the workers at the end of each epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: ramp the learning rate up from BASE_LR over the first epoch.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=BASE_LR * hvd.size(), warmup_epochs=1,
                                             steps_per_epoch=STEPS_PER_EPOCH),
]
# Horovod: save checkpoints only on worker 0.
if hvd.rank() == 0:
  callbacks.append(tf.keras.callbacks.ModelCheckpoint(
      os.path.join(CHECKPOINT_DIR, "checkpoint-{epoch}.h5")))

model.fit(dataset, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, callbacks=callbacks,
          verbose=2 if hvd.rank() == 0 else 0)
loss, accuracy = model.evaluate(test_images, test_labels, batch_size=1000, verbose=0)
if hvd.rank() == 0:
  print(f"test accuracy {accuracy:.4f}")
