"""The patch mechanism on stand-in owners: install, revert, applied, guards, threads,
patches for a while and of one instance; and the package's list of its patches."""

import ast
import logging
import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest

import tf_adacomp  # registers every patch of the package
from tf_adacomp import ema
from tf_adacomp.compat import internals
from tf_adacomp.compat import keras_multi_worker
from tf_adacomp.compat import loss_scale
from tf_adacomp.compat import patches
from tf_adacomp.steps import arguments

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Owner:
  """A stand-in for a framework class."""

  def method(self, x):
    return ("original", x)


class _Child(_Owner):
  """Inherits ``method``: it is not the child's own attribute."""


def _wrap(original):
  def method(self, x):
    return ("patched", original(self, x))
  return method


@pytest.fixture
def patch():
  """A registered patch of ``_Owner.method``, reverted and unregistered afterwards."""
  made = patches.register(patches.Patch(name="test._Owner.method", owner=lambda: _Owner,
                                        attribute="method", wrap=_wrap))
  yield made
  patches.revert(made.name)
  patches._PATCHES.pop(made.name)  # pylint: disable=protected-access


def test_the_package_registers_its_patches():
  assert {keras_multi_worker.SYMBOLIC_BUILD, keras_multi_worker.REDUCE_PER_REPLICA,
          loss_scale.CHECK_FINITE, *internals.COLLECTIVE_KEY_BASES, internals.LOCAL_DEVICES,
          internals.ALL_REDUCE_SUMMED, internals.ALL_REDUCE_LOCAL,
          *ema.DEFERRED} <= set(patches.names())


def _listed_patches():
  """``{name: [(file, test), ...]}`` of the list in ``compat.patches``' docstring."""
  listed, name = {}, None
  for line in patches.__doc__.splitlines():
    entry = re.match(r"- ``([^`]+)``:", line)
    if entry:
      name = entry.group(1)
      listed[name] = []
    canary = re.match(r"\s+Canary: ``([^`:]+)::([^`]+)``", line)
    if canary:
      listed[name].append(canary.groups())
  return listed


def test_the_docstring_lists_every_registered_patch_with_a_canary():
  listed = _listed_patches()
  registered = [n for n in patches.names() if not n.startswith("test.")]
  assert sorted(listed) == sorted(registered)
  for name, canaries in listed.items():
    assert canaries, f"{name} is listed without a canary"
    for path, test in canaries:
      tree = ast.parse((ROOT / path).read_text())
      tests = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
      assert test in tests, f"the canary of {name}, {path}::{test}, does not exist"


def test_the_all_reduce_patches_replace_the_hook_the_wrapper_checks():
  assert internals.ALL_REDUCE_METHOD == arguments.ALL_REDUCE_HOOK


@pytest.mark.slow  # a process of its own
def test_importing_the_package_installs_only_the_collective_key_bases():
  code = ("import tf_adacomp\nfrom tf_adacomp.compat import patches\n"
          "print('RESULT', patches.applied_now())")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
  lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
  assert lines == [f"RESULT {internals.COLLECTIVE_KEY_BASES}"], result.stderr[-2000:]


def test_install_revert_applied(patch):
  original = _Owner.__dict__["method"]
  assert not patches.applied(patch.name) and patches.original(patch.name) is original
  assert patches.install(patch.name)
  assert patches.applied(patch.name)
  assert getattr(_Owner.method, patches.MARK) == patch.name
  assert _Owner().method(1) == ("patched", ("original", 1))
  assert patches.original(patch.name) is original
  assert not patches.install(patch.name)  # once: a second call installs nothing
  assert _Owner().method(1) == ("patched", ("original", 1))
  assert patches.revert(patch.name)
  assert not patches.applied(patch.name) and _Owner.__dict__["method"] is original
  assert not patches.revert(patch.name)


def test_a_guard_that_finds_the_bug_fixed_leaves_the_original(patch):
  fixed = patches.register(patches.Patch(name="test.fixed", owner=lambda: _Owner,
                                         attribute="method", wrap=_wrap,
                                         needed=lambda original: False))
  try:
    assert not patches.needed(fixed.name)
    assert not patches.install(fixed.name)
    assert _Owner().method(1) == ("original", 1)
  finally:
    patches._PATCHES.pop(fixed.name)  # pylint: disable=protected-access


def test_an_owner_that_does_not_apply_is_left_alone():
  absent = patches.register(patches.Patch(name="test.absent", owner=lambda: None,
                                          attribute="method", wrap=_wrap))
  try:
    assert not patches.needed(absent.name) and patches.original(absent.name) is None
    assert not patches.install(absent.name) and not patches.applied(absent.name)
  finally:
    patches._PATCHES.pop(absent.name)  # pylint: disable=protected-access


def test_an_inherited_attribute_is_missing_and_warns_once(caplog):
  child = patches.register(patches.Patch(name="test.child", owner=lambda: _Child,
                                         attribute="method", wrap=_wrap,
                                         missing="the stand-in has no method of its own"))
  try:
    with caplog.at_level(logging.WARNING, logger="tf_adacomp"):
      assert not patches.install(child.name)
      assert not patches.install(child.name)
    lines = [r.getMessage() for r in caplog.records if r.name == "tf_adacomp"]
    assert len(lines) == 1 and "the stand-in has no method of its own" in lines[0]
    assert "Keras" in lines[0]  # the installed versions
    assert "method" not in vars(_Child)
  finally:
    patches._PATCHES.pop(child.name)  # pylint: disable=protected-access


def test_revert_leaves_what_something_else_installed_since(patch):
  original = _Owner.__dict__["method"]
  assert patches.install(patch.name)

  def other(self, x):
    return ("other", x)

  _Owner.method = other
  try:
    assert not patches.applied(patch.name)
    assert not patches.revert(patch.name)
    assert _Owner.__dict__["method"] is other
  finally:
    _Owner.method = original


def test_threads_install_once():
  wrapped = []

  def counting_wrap(original):
    wrapped.append(original)
    return _wrap(original)

  counted = patches.register(patches.Patch(name="test.threads", owner=lambda: _Owner,
                                           attribute="method", wrap=counting_wrap))
  installed = []
  try:
    threads = [threading.Thread(target=lambda: installed.append(patches.install(counted.name)))
               for _ in range(8)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    assert installed.count(True) == 1 and len(wrapped) == 1
  finally:
    patches.revert(counted.name)
    patches._PATCHES.pop(counted.name)  # pylint: disable=protected-access


def test_two_patches_under_one_name_are_refused(patch):
  with pytest.raises(ValueError, match="already registered as 'test._Owner.method'"):
    patches.register(patches.Patch(name=patch.name, owner=lambda: _Owner, attribute="method",
                                   wrap=_wrap))
  assert patches.register(patch) is patch  # the same one again: a no-op


def test_an_unknown_name_is_a_key_error():
  with pytest.raises(KeyError, match="No patch is registered as 'nope'"):
    patches.install("nope")


def test_install_hands_its_arguments_to_wrap():
  made = patches.register(patches.Patch(
      name="test.arguments", owner=lambda: _Owner, attribute="method",
      wrap=lambda original, tag: lambda self, x: (tag, original(self, x))))
  try:
    assert patches.install(made.name, "first")
    assert not patches.install(made.name, "second")  # installed once: first's wrapper
    assert _Owner().method(1) == ("first", ("original", 1))
  finally:
    patches.revert(made.name)
    patches._PATCHES.pop(made.name)  # pylint: disable=protected-access


def test_patched_installs_for_a_while(patch):
  original = _Owner.__dict__["method"]
  with pytest.raises(ZeroDivisionError):
    with patches.patched(patch.name):
      assert patches.applied(patch.name)
      assert _Owner().method(1) == ("patched", ("original", 1))
      1 / 0  # pylint: disable=pointless-statement
  assert not patches.applied(patch.name) and _Owner.__dict__["method"] is original


def test_patched_does_not_nest(patch):
  with patches.patched(patch.name):
    with pytest.raises(RuntimeError, match="is applied already"):
      with patches.patched(patch.name):
        pass
    assert patches.applied(patch.name)  # the outer one still holds
  assert not patches.applied(patch.name)


def test_patched_refuses_a_patch_that_cannot_apply():
  absent = patches.register(patches.Patch(name="test.absent_for_a_while", owner=lambda: None,
                                          attribute="method", wrap=_wrap))
  try:
    with pytest.raises(RuntimeError, match="does not apply here"):
      with patches.patched(absent.name):
        pass
  finally:
    patches._PATCHES.pop(absent.name)  # pylint: disable=protected-access


@pytest.fixture
def instance_patch():
  """A registered instance patch of ``method``, unregistered afterwards."""
  made = patches.register(patches.InstancePatch(
      name="test.instance", attribute="method",
      wrap=lambda original, tag="patched": lambda x: (tag, original(x)),
      missing="{type} has no `{attribute}` ({versions})"))
  yield made
  patches._PATCHES.pop(made.name)  # pylint: disable=protected-access


def test_an_instance_patch_changes_one_object_only(instance_patch):
  name = instance_patch.name
  one, other = _Owner(), _Owner()
  assert not patches.instance_applied(one, name)
  assert patches.patch_instance(one, name, "tag")
  assert patches.instance_applied(one, name) and not patches.instance_applied(other, name)
  assert getattr(vars(one)["method"], patches.MARK) == name
  assert one.method(1) == ("tag", ("original", 1))
  assert other.method(1) == ("original", 1) and "method" not in vars(_Owner())
  assert _Owner.__dict__["method"] is not vars(one)["method"]
  assert not patches.patch_instance(one, name, "again")  # once
  assert one.method(1) == ("tag", ("original", 1))
  assert patches.unpatch_instance(one, name)
  assert "method" not in vars(one) and one.method(1) == ("original", 1)
  assert not patches.unpatch_instance(one, name)


def test_unpatching_an_instance_puts_back_what_it_held_itself(instance_patch):
  obj = _Owner()
  own = lambda x: ("own", x)  # pylint: disable=unnecessary-lambda-assignment
  obj.method = own
  assert patches.patch_instance(obj, instance_patch.name)
  assert obj.method(1) == ("patched", ("own", 1))
  assert patches.unpatch_instance(obj, instance_patch.name)
  assert vars(obj)["method"] is own


def test_unpatching_an_instance_leaves_what_something_else_set_since(instance_patch):
  obj = _Owner()
  assert patches.patch_instance(obj, instance_patch.name)
  other = lambda x: ("other", x)  # pylint: disable=unnecessary-lambda-assignment
  obj.method = other
  assert not patches.instance_applied(obj, instance_patch.name)
  assert not patches.unpatch_instance(obj, instance_patch.name)
  assert vars(obj)["method"] is other


def test_an_instance_without_the_attribute(instance_patch):
  with pytest.raises(RuntimeError, match="NoMethod has no `method`"):
    patches.patch_instance(object.__new__(type("NoMethod", (), {})), instance_patch.name)
  quiet = patches.register(patches.InstancePatch(name="test.instance_quiet", attribute="gone",
                                                 wrap=lambda original: lambda: original))
  try:
    holder = type("Holder", (), {})()
    assert patches.patch_instance(holder, quiet.name)  # nothing to replace: set anyway
    assert holder.gone() is None
    assert patches.unpatch_instance(holder, quiet.name) and not hasattr(holder, "gone")
  finally:
    patches._PATCHES.pop(quiet.name)  # pylint: disable=protected-access


def test_the_kinds_are_not_mixed_up(patch, instance_patch):
  with pytest.raises(TypeError, match="install it with patch_instance"):
    patches.install(instance_patch.name)
  with pytest.raises(TypeError, match="use install"):
    patches.patch_instance(_Owner(), patch.name)
  assert instance_patch.name not in patches.applied_now()


def test_the_wrappers_all_reduce_patches_are_on_the_instance():
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  inner = keras.optimizers.SGD(0.1)
  outer = keras.optimizers.SGD(1.0)
  variable = keras.Variable(np.zeros(2, np.float32))
  from tf_adacomp.steps import inner as inner_lib  # pylint: disable=import-outside-toplevel
  inner_lib.build(inner, [variable], per_replica=False, outer_optimizer=outer)
  for optimizer in (inner, outer):
    assert patches.instance_applied(optimizer, internals.ALL_REDUCE_SUMMED)
    assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]  # pylint: disable=protected-access
  assert not patches.instance_applied(keras.optimizers.SGD(0.1), internals.ALL_REDUCE_SUMMED)
