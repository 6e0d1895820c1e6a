"""megatron-rrfp: readiness-first pipeline-parallel training for Megatron-core.

CPU machines: install with ``pip install torch==2.13.0 -e .[test]`` so pip takes the CPU
wheel instead of resolving ``torch`` to a multi-GB CUDA build. GPU hosts keep their own
torch (any release megatron-core supports): ``pip install -e .``.
"""
from setuptools import find_packages, setup

setup(
    name="megatron-rrfp",
    version="0.1.0",
    description="Readiness-first pipeline-parallel executor, simulator and goodput ledger for Megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rrfp", "megatron_rrfp.*"]),
    install_requires=[
        # No torch pin: GPU users keep their own CUDA build. CPU installs pin torch==2.13.0
        # on the pip command line (see README) to take the on-disk CPU wheel.
        "torch",
        "megatron-core>=0.15,<0.20",
        "numpy",
        "tqdm",
        "matplotlib",  # timelines and goodput charts
        "packaging",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis"],
    },
    entry_points={"console_scripts": ["megatron-rrfp=megatron_rrfp.cli:main"]},
)
