"""Kept for tools that still call setup.py; the project is declared in pyproject.toml.

CPU machines: ``pip install torch==2.13.0 -e '.[test]'`` so pip takes the CPU wheel
instead of resolving ``torch`` to a multi-GB CUDA build. GPU hosts keep their own torch
(any release megatron-core supports): ``pip install -e .``.
"""
from setuptools import setup

setup()
