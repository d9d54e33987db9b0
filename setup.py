"""Setuptools shim: metadata lives in pyproject.toml (``pip install .`` reads it)."""
from setuptools import setup

setup()
