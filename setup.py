from setuptools import find_packages, setup

setup(
    name="dflash",
    version="0.1.0",
    description="Train DFlash speculative-decoding drafters through an asyncio pipeline",
    python_requires=">=3.11",
    packages=find_packages(include=["dflash", "dflash.*"]),
    # torch: any build >= 2.6 (CPU or CUDA); the Makefile pins 2.13.0 only where no torch is installed.
    install_requires=[
        "torch>=2.6",
        "transformers>=4.57",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "structlog>=24.1",
        "click>=8.1",
        "pydantic>=2.7",
        "tomli-w>=1.0",
        "uvloop>=0.19; sys_platform != 'win32'",
    ],
    extras_require={"dev": ["pytest>=8", "ruff>=0.6"]},
    entry_points={"console_scripts": ["dflash=dflash.cli:entry"]},
)
