"""tf_adacomp.xla_cache: TensorFlow's persistent XLA cache, set before TensorFlow starts.

The flag is read once per process, so each behaviour runs in a fresh Python process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tf_adacomp import xla_cache

_KERNEL_RUN = """
import numpy as np
import tensorflow as tf
from tf_adacomp.ops import adacomp_bucket
payload, _ = adacomp_bucket.compress([np.ones([64], np.float32)], [np.zeros([64], np.float32)], 8)
print("count", int(payload[0]))
"""


def _python(code, env=None):
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


@pytest.mark.slow
def test_enable_before_tensorflow_starts_persists_the_compiled_kernels(tmp_path):
  cache = tmp_path / "xla"
  out = _python(textwrap.dedent(f"""
      import os
      from tf_adacomp import xla_cache
      assert xla_cache.enable({str(cache)!r}) == {str(cache)!r}
      assert os.environ["TF_XLA_FLAGS"].endswith("--tf_xla_persistent_cache_directory={cache}")
      """) + _KERNEL_RUN, env={"TF_XLA_FLAGS": ""})
  assert "count 64" in out
  assert [f for f in os.listdir(cache) if f.startswith("xla_compile_cache")]
  assert (os.stat(cache).st_mode & 0o777) == 0o700


@pytest.mark.slow
def test_enable_after_tensorflow_started_is_refused_naming_the_environment_variable():
  out = _python("""
      import tensorflow as tf
      from tf_adacomp import xla_cache
      tf.constant(1.0)
      try:
        xla_cache.enable("/nonexistent/never/created")
      except RuntimeError as error:
        print("refused:", error)
      """, env={"TF_XLA_FLAGS": ""})
  assert "refused:" in out and "TF_XLA_FLAGS" in out
  assert not os.path.exists("/nonexistent/never/created")


def test_a_directory_already_in_the_environment_is_kept(monkeypatch):
  monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_foo=1 --tf_xla_persistent_cache_directory=/x/y")
  assert xla_cache.current_directory() == "/x/y"
  # Even after TensorFlow started (as in this process): nothing to change.
  assert xla_cache.enable("/somewhere/else") == "/x/y"


def test_a_directory_that_is_not_a_path_is_refused_naming_it():
  with pytest.raises(TypeError, match="directory=3"):
    xla_cache.enable(3)


def test_the_default_directory_is_per_user_and_per_tensorflow_version(monkeypatch):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.cache")
  assert xla_cache.default_directory() == f"/home/u/.cache/tf_adacomp/xla/tf-{tf.__version__}"


def test_the_test_run_keeps_compiled_programs_out_of_the_users_cache():
  # tests/conftest.py: what the examples the tests start would use (they inherit this
  # process's environment; a fresh interpreter reads it as they do, and fast: no TF).
  run_cache = os.environ["TF_ADACOMP_TEST_CACHE"].partition(":")[2]
  user_cache = os.path.join(os.path.expanduser("~"), ".cache")
  seen = subprocess.run(
      [sys.executable, "-c", "import os; print(os.environ.get('XDG_CACHE_HOME', '')); "
       "print(os.environ.get('TF_XLA_FLAGS', ''))"],
      capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
  assert seen[0] == run_cache != user_cache
  assert xla_cache.default_directory().startswith(run_cache + os.sep)
  # No persistent cache directory from the user's TF_XLA_FLAGS: it would win over
  # XDG_CACHE_HOME (enable() keeps the environment's choice).
  assert xla_cache.FLAG not in seen[1]
  assert xla_cache.current_directory() is None
