"""What ``kvserve serve`` checks before it loads anything, so that a mistake is reported in a second, not after the
model has loaded, and in the words the user typed: flags, not ServeConfig's fields.

Loading the embedded model takes seconds, a larger one minutes; a port in use or a model path with a typo is known
before either. Only what can be known without loading is checked here (the loader still reports what only reading
the weights can tell). Imports stay light: no torch, no transformers.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import socket
from pathlib import Path

from kvserve.server.config import ServeConfig

# ``--model`` names for the embedded SmolLM2 (engine.loader.DEFAULT_MODEL; tests/test_cli.py keeps them equal, as
# importing the loader here would import torch)
EMBEDDED_MODEL = "smollm2"
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (the GGUF specification, "File Structure")

# ServeConfig fields whose flag is not the field's name with dashes
FIELD_FLAGS = {"policy": "--scheduler", "enable_prefix_caching": "--no-prefix-caching", "sse_ping_s": "--sse-ping-seconds",
               "drain_s": "--drain-seconds", "header_timeout_s": "--header-timeout-seconds", "api_key": "--api-key",
               "api_keys": "--api-key", "ui": "--no-ui", "body_timeout_s": "--body-timeout-seconds",
               "admin_keys": "--admin-key", "kv_events": "--kv-events-config"}


def flag_of(field: str) -> str:
    """The ``kvserve serve`` flag that sets a ServeConfig field (``max_num_seqs`` -> ``--max-num-seqs``)."""
    return FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


def in_flags(message: str) -> str:
    """``message`` (a ServeConfig error) with its field names written as the flags that set them.

    A field with an underscore is a field wherever it appears; a one-word field (``port``, ``model``) only where it
    starts the message and is followed by ``must`` or a colon, as ServeConfig words its errors (elsewhere it is
    probably an English word)."""
    fields = [f.name for f in dataclasses.fields(ServeConfig)]
    snake = sorted((name for name in fields if "_" in name), key=len, reverse=True)
    message = re.sub(r"(?<![\w-])(" + "|".join(snake) + r")(?![\w-])", lambda m: flag_of(m.group(1)), message)
    words = "|".join(name for name in fields if "_" not in name)
    return re.sub(rf"^({words})(?=:| must)", lambda m: flag_of(m.group(1)), message)


def problems(config: ServeConfig) -> list[str]:
    """Every mistake that can be found without loading: the model paths, then the address to listen on. Each is
    one line that names the flag and says what to do."""
    found = [model_path_problem("--model", config.model),
             model_path_problem("--draft-model", config.draft_model) if config.draft_model else None,
             flags_problem(config), listen_problem(config.host, config.port)]
    return [line for line in found if line]


def flags_problem(config: ServeConfig) -> str | None:
    """Flags that cannot work together, or on this machine, beyond ServeConfig's own checks of each value: the
    GGUF's own blocks of a model that is no GGUF file (engine.weights.choose says the same after loading), and a
    GPU asked for where there is none."""
    from kvserve.engine.options import Device, cuda_present
    from kvserve.quant.options import Scheme

    gguf = config.model is None or config.model == EMBEDDED_MODEL or config.model.endswith(".gguf")
    if config.quantization is Scheme.GGUF and not gguf:
        return (f"--quantization gguf serves a GGUF file's own blocks, and --model {config.model} is not a .gguf "
                "file (auto picks int8 for a float checkpoint)")
    if config.device is Device.CUDA and not cuda_present():
        return "--device cuda, but this machine has no CUDA device (or torch sees none); --device auto uses the CPU"
    return None


def model_path_problem(flag: str, value: str | None) -> str | None:
    """Why ``value`` cannot be the model (None: it can, as far as a look without loading can tell).

    A model is a GGUF file named ``*.gguf`` or a directory with a config.json (a Hugging Face model directory), and
    kvserve must be able to read it. None and ``smollm2`` are the embedded model.
    """
    if value is None or value == EMBEDDED_MODEL:
        return None
    path = Path(value).expanduser()
    if not path.exists():
        hub = "" if value.startswith((".", "/", "~")) or value.count("/") != 1 else (
            f" ({value} looks like a model hub id: kvserve never downloads, so download it first and give its "
            "local directory)")
        return f"{flag} {value}: no such file or directory{hub}"
    if path.is_file():
        try:
            magic = _magic(path)
        except OSError as exc:
            return f"{flag} {value}: cannot be read ({exc.strerror or exc})"
        if magic != GGUF_MAGIC:
            return (f"{flag} {value}: a file, but not a GGUF file; give a GGUF file or a Hugging Face model "
                    "directory (the folder with config.json)")
        if path.suffix != ".gguf":
            return f"{flag} {value}: a GGUF file, but its name does not end in .gguf, which is how kvserve tells one"
        return None
    if not path.is_dir():
        return f"{flag} {value}: neither a file nor a directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{flag} {value}: the directory cannot be read (permission denied)"
    config = path / "config.json"
    if not config.is_file():
        ggufs = [p for p in sorted(path.glob("*.gguf")) if _readable_gguf(p)]  # not an empty or partial download
        hint = f"; it holds a GGUF file: {flag} {ggufs[0]}" if ggufs else ""
        return (f"{flag} {value}: a directory without config.json, so not a Hugging Face model directory "
                f"(kvserve never downloads){hint}")
    if not os.access(config, os.R_OK):
        return f"{flag} {value}: {config.name} cannot be read (permission denied)"
    return None


def _magic(path: Path) -> bytes:
    """The first bytes of ``path``, as many as a GGUF file's magic (fewer for a shorter file). Raises OSError."""
    with path.open("rb") as handle:
        return handle.read(len(GGUF_MAGIC))


def _readable_gguf(path: Path) -> bool:
    """Whether ``path`` is a readable file that starts as a GGUF file does."""
    try:
        return path.is_file() and _magic(path) == GGUF_MAGIC
    except OSError:
        return False


def listen_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (None: it can, now). Binds a socket as uvicorn will
    (SO_REUSEADDR, so a port left in TIME_WAIT by an earlier run is not reported) and closes it at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            return f"--host {host}: not an address or a name this machine resolves ({exc.strerror})"
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"--port {port}: {host}:{port} is already in use (another server listens there); stop it "
                        "or choose another --port")
            if exc.errno == errno.EACCES:
                return f"--port {port}: permission denied (ports below 1024 need root); choose another --port"
            return f"--host {host}: cannot listen there ({exc.strerror or exc})"
    return None
