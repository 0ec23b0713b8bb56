"""tf_adacomp.log: information reads as information, once, without absl's prefix.

Run in a process of its own, as an absl program (the examples are absl programs): there
absl's root handler prefixes every record with ``W1126 13:52:16.780130 ... file.py:73]``.
The module is loaded from its file, without TensorFlow, so that this takes a second.
"""

import pathlib
import subprocess
import sys
import textwrap

LOG_PY = pathlib.Path(__file__).resolve().parent.parent / "tf_adacomp" / "log.py"

PROGRAM = textwrap.dedent("""
    import importlib.util, logging, sys
    from absl import app

    spec = importlib.util.spec_from_file_location("tf_adacomp_log", sys.argv[1])
    log = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(log)

    def main(argv):
      if argv[2] == "user":  # the user set the logger up before: theirs is kept
        logging.getLogger("tf_adacomp").setLevel(logging.WARNING)
      log.info("compiled %d XLA programs in %.1f s.", 7, 5.04)
      log.warning("a problem.")

    app.run(main)
""")


def _run(mode):
  return subprocess.run([sys.executable, "-c", PROGRAM, str(LOG_PY), mode],
                        capture_output=True, text=True, timeout=60, check=True)


def test_information_is_one_plain_line_in_an_absl_program():
  lines = _run("default").stderr.splitlines()
  assert lines == ["tf_adacomp: compiled 7 XLA programs in 5.0 s.",
                   "tf_adacomp WARNING: a problem."], lines


def test_a_logger_the_user_configured_is_left_as_it_is():
  lines = [line for line in _run("user").stderr.splitlines() if "tf_adacomp" in line
           or "problem" in line]
  assert not any("XLA programs" in line for line in lines), lines  # their level: WARNING
  assert len(lines) == 1 and lines[0].endswith("a problem.") and lines[0].startswith("W")
