"""Which form of a kernel to build: for XLA:CPU or for XLA:GPU, chosen by device type.

A few of AdaComp's steps skip work by control flow: the encoder encodes only the
smallest tier of slots that holds what is sent (``tf.cond``), the decoder unpacks and
adds only the chunks that hold codes (``tf.while_loop``). On XLA:CPU that saves the
work. On XLA:GPU every conditional and every loop iteration waits for its predicate on
the host, a round trip of tens of microseconds: on an H100 the decoder's iterations
made most of a compressed ResNet-50 step (docs/gpu.md). The GPU form does the same
arithmetic without the control flow: it
encodes the full capacity and keeps the tier's slots (up to
``adacomp_core.GPU_FULL_ENCODE_MAX_SLOTS``; past it the tiers cost less), and adds every
chunk at once.
The two give bit-identical payloads and sums (tests/ops/test_variant.py).

The form is chosen when a kernel is traced, from the device it is placed on: a GPU, or
no device named while TensorFlow sees a GPU (where it places an unplaced op).
"""

import contextlib

import tensorflow as tf

FORMS = ("cpu", "gpu")
_forced = []


def gpu_form(tensor: tf.Tensor) -> bool:
  """Whether the kernel that ``tensor`` belongs to is built in its GPU form.

  Args:
    tensor: a tensor of the kernel being traced (its device is the kernel's).

  Returns:
    True for the GPU form: forced by ``forced``, or ``tensor`` on a GPU, or on no named
    device while TensorFlow has a logical GPU.
  """
  if _forced:
    return _forced[-1] == "gpu"
  device = tensor.device or ""
  if device:
    return "GPU" in device.upper()
  return bool(tf.config.list_logical_devices("GPU"))


def forced_form():
  """The form ``forced`` imposes here, or None where the device chooses."""
  return _forced[-1] if _forced else None


@contextlib.contextmanager
def forced(form: str):
  """Within this block, kernels traced are built in ``form`` whatever their device.

  For tests (each form on CPU) and for benchmarks that export a GPU program from a
  machine without a GPU. Process-wide, not per thread; a ``tf.function`` traced inside
  the block keeps its form.

  Args:
    form: ``"cpu"`` or ``"gpu"``.

  Raises:
    ValueError: ``form`` is neither.
  """
  if form not in FORMS:
    raise ValueError(f"`form` must be one of {FORMS}. Received: form={form!r}")
  _forced.append(form)
  try:
    yield
  finally:
    _forced.pop()
