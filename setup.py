"""Build and install bert_fast.

The CUDA/C++ extension (csrc/) is a separate work item; until it lands this installs the
pure-Python package (its torch backend runs on any device PyTorch supports).
"""

from setuptools import find_packages, setup

setup(
    name="bert_fast",
    version="0.1.0",
    description="Fast drop-in BERT encoder for PyTorch: fused kernels behind reference-compatible modules",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["bert_fast", "bert_fast.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",  # torch.library.triton_op
        "numpy",
        "triton; platform_system == 'Linux'",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "ninja"],
        "plot": ["matplotlib"],
    },
)
