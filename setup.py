from setuptools import find_packages, setup

setup(
    name="inmem_ft",
    version="0.1.0",
    description="In-memory, erasure-coded fault tolerance for DeepSpeed and Megatron pretraining",
    license="Apache-2.0",
    packages=find_packages(include=["inmem_ft", "inmem_ft.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Pinned: any other torch pulls a multi-GB CUDA build on a CPU-only machine (see constraints.txt).
        "torch==2.13.0",
        "numpy<2.4",
        "pyarrow",
        "xxhash>=3",
        "cryptography>=50",  # AES-GMAC over SMP-to-SMP payloads (cluster/mac.py)
        "tqdm",
        "pyeclib==1.8.0",  # only for the ISA-L shared library it bundles
        "packaging",  # the tested-range check of the adapters (compat.py)
    ],
    extras_require={
        "deepspeed": ["deepspeed==0.19.8"],
        # Python >= 3.12; on 3.11: pip install --ignore-requires-python megatron-core==0.19.2 psutil
        "megatron": ["megatron-core==0.19.2", "psutil"],
        "plot": ["matplotlib"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "matplotlib", "psutil", "deepspeed==0.19.8"],
    },
    entry_points={"console_scripts": ["inmem-ft=inmem_ft.cli:main"]},
)
