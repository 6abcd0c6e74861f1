"""hvd_compress: gradient compression for Horovod (PyTorch and TensorFlow).

The top-level ``kernels/`` folder is installed as ``hvd_compress.kernels``.
"""
import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "hvd_compress" / "__init__.py").read_text()).group(1)

setup(
    name="hvd_compress",
    version=VERSION,
    description="Gradient-compression plugin for Horovod (PyTorch and TensorFlow) with Triton kernels",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["hvd_compress", "hvd_compress.compressors", "hvd_compress.torch",
              "hvd_compress.tensorflow", "hvd_compress.kernels"],
    package_dir={"hvd_compress.kernels": "kernels"},
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16"],
        "triton": ["triton"],
        "horovod": ["horovod==0.28.1"],
    },
)
