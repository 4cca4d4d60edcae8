"""deadpool-megatron: hot-swap fault tolerance for Megatron-LM training."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="deadpool-megatron",
    version="0.1.0",
    description="Hot-swap fault tolerance for Megatron-LM training (DeadPool, arXiv 2607.01646)",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["deadpool_megatron", "deadpool_megatron.*"]),
    py_modules=["pretrain_gpt"],
    install_requires=[
        # Not pinned: GPU clusters bring their own CUDA build of torch. On a CPU machine
        # install torch==2.13.0 (the CPU wheel) first, or pip fetches a multi-GB CUDA build.
        "torch>=2.4",
        # 0.16.1 is the newest release for Python 3.11; 0.17-0.19 need Python 3.12.
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "packaging",
        "psutil",  # dist_checkpointing's writer processes need it
        "pyyaml",
        "xxhash",  # checksums of snapshots and replicas
        "matplotlib",  # deadpool-report and benchmark plots
    ],
    extras_require={
        # NVIDIA apex is built from source: see the README ("GPU clusters").
        "gpu": ["transformer-engine[pytorch]"],
        "mpi": ["mpi4py>=4"],
        "test": ["pytest>=8", "pytest-timeout", "ruff", "hypothesis"],
    },
    entry_points={
        "console_scripts": [
            "deadpool-launch=deadpool_megatron.launch:main",
            "deadpool-report=deadpool_megatron.report:main",
        ]
    },
)
