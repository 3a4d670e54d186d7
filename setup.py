"""megatron-wlb: workload-balanced 4D parallelism (WLB-LLM, OSDI'25) for Megatron-LM."""

import re
import runpy

from setuptools import find_packages, setup

# one place for the version: megatron_wlb/__init__.py (what `wlb --version` prints)
VERSION = re.search(r'^__version__ = "([^"]+)"', open("megatron_wlb/__init__.py").read(), re.M).group(1)
# one place for the packages Megatron's training code needs beyond torch (no imports: read as a script)
REQUIREMENTS = runpy.run_path("megatron_wlb/requirements.py", run_name="setup")

setup(
    name="megatron-wlb",
    version=VERSION,
    description="Workload-balanced document packing and context-parallel sharding for Megatron-LM "
                "(an open implementation of WLB-LLM, OSDI'25)",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The shipped run configs live at the top of the checkout (configs/); the wheel carries them as
    # megatron_wlb/configs/, where megatron_wlb.config finds them once installed (one copy of each file).
    packages=[*find_packages(include=["megatron_wlb", "megatron_wlb.*"]), "megatron_wlb.configs"],
    package_dir={"megatron_wlb.configs": "configs"},
    # Data files the package reads through importlib.resources / __file__ (tests/test_wheel.py checks
    # that every non-Python file under megatron_wlb/ and configs/ is listed here).
    package_data={"megatron_wlb": ["data/*.json", "data/*.md", "cp/data/*.json"], "megatron_wlb.configs": ["*.yaml"]},
    license="Apache-2.0",
    license_files=["LICENSE"],
    # The core (cost model, packers, shard layouts, simulator, CLI) needs no torch.
    install_requires=[
        "numpy>=1.24",
        "highspy>=1.7",      # the MILP solver of the fixed-solver baseline
        "pyyaml>=6",
        "tqdm>=4.60",
        "matplotlib>=3.7",   # figures of `wlb reproduce` / `wlb analyze`
    ],
    extras_require={
        # Any torch >= 2.4 works; CPU-only machines install torch==2.13.0 first (see README).
        "torch": ["torch>=2.4"],
        # The releases CI trains with: 0.19.x (its wheel ships megatron/training; our launcher) and a
        # core_v0.16.1 checkout (patched pretrain_gpt.py). megatron-core imports triton unconditionally,
        # also on CPU; Megatron-LM's training code also imports six, regex and pydantic, which the core
        # wheel does not declare (megatron_wlb/requirements.py lists them), and a checkout compiles its
        # dataset helpers with pybind11; Megatron's default checkpoint format (torch_dist) writes with psutil;
        # Megatron's SFTTokenizer (--sft, `wlb analyze --sft-jsonl`) loads its tokenizer with transformers.
        "megatron": ["torch>=2.4", "megatron-core>=0.16,<0.20,!=0.17.*,!=0.18.*", "triton", "pybind11", "psutil",
                     "transformers", *REQUIREMENTS["MEGATRON"]],
        # tokenizers + transformers: the docs' offline tokenizer recipe (scripts/train_tokenizer.py), tested
        "test": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "ruff>=0.5", "mypy>=1.10", "tokenizers",
                 "transformers"],
    },
    entry_points={"console_scripts": ["wlb=megatron_wlb.cli.main:main"]},
    classifiers=["Programming Language :: Python :: 3"],
)
