from setuptools import find_packages, setup

setup(
    name="piper_fx",
    version="0.1.0",
    description="A torch.compile backend for programmable distributed training",
    packages=find_packages(include=["piper_fx", "piper_fx.*"]),
    python_requires=">=3.10",
    # 2.11 (what GPU images ship) through 2.13; the Makefile pins 2.13.0 (CPU build) for its venv.
    # The private torch APIs this needs, and the version check, are in piper_fx/compat.py.
    install_requires=["torch>=2.11,<2.14", "numpy"],
    entry_points={"torch_dynamo_backends": ["piper = piper_fx.backend:piper_backend"]},
)
