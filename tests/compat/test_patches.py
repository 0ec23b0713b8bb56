"""The patch mechanism on stand-in owners: install, revert, applied, guards, threads."""

import logging
import threading

import pytest

from tf_adacomp.compat import keras_multi_worker
from tf_adacomp.compat import loss_scale
from tf_adacomp.compat import patches


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
          loss_scale.CHECK_FINITE} <= set(patches.names())


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
