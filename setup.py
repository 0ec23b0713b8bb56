"""Kept for tools that still look for a setup.py; all metadata lives in pyproject.toml."""

from setuptools import setup

setup()
