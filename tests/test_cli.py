"""``kvserve serve``'s command line: every option explained with its default, in groups; mistakes reported before
loading, in the flags' own names; the README's options table generated from the same parser."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.server import options_table, preflight, serve
from kvserve.server.cli import main as kvserve_main
from kvserve.server.config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_option_has_help_and_shows_its_default():
    parser = options_table.serve_parser()
    helps = {}
    for action in options(parser):
        formatter = parser._get_formatter()
        helps[action.option_strings[0]] = " ".join(formatter._expand_help(action).split())
    assert len(helps) >= 35
    for flag, text in helps.items():
        assert len(text.split("(default: ")[0].strip()) >= 15, f"{flag} has no help of its own: {text!r}"
        assert "(default: " in text and not text.endswith("(default: None)"), f"{flag} shows no default: {text!r}"
    assert helps["--port"].endswith("(default: 8000)")
    assert helps["--model"].endswith("(default: the embedded SmolLM2-135M-Instruct)") and "GGUF file" in helps["--model"]
    assert helps["--no-prefix-caching"].endswith("(default: off: the prefix cache is on)")
    shown = " ".join(parser.format_help().split())
    assert "--kv-cache-memory BYTES the KV pool's budget" in shown


def test_options_come_in_vllms_groups_and_none_is_left_out():
    parser = options_table.serve_parser()
    grouped = {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups}
    assert [t for t in grouped if t.endswith(" options") and t != "options"] == [f"{n} options" for n in serve.GROUPS]
    assert grouped["options"] == ["-h"]  # every flag is in a named group
    assert {"--model", "--quantization", "--dtype"} <= set(grouped["model options"])
    assert {"--kv-cache-memory", "--kv-cache-dtype", "--block-size"} <= set(grouped["memory options"])
    assert {"--api-key", "--allowed-hosts"} <= set(grouped["security options"])
    assert {"--step-log", "--log-level"} <= set(grouped["observability options"])


def test_every_config_field_has_its_flag_and_errors_name_flags_as_typed():
    flags = {s for a in options(options_table.serve_parser()) for s in a.option_strings}
    for field in dataclasses.fields(ServeConfig):
        assert preflight.flag_of(field.name) in flags, field.name
    assert preflight.in_flags("max_num_batched_tokens must be >= max_num_seqs (one decode token per slot)") == \
        "--max-num-batched-tokens must be >= --max-num-seqs (one decode token per slot)"
    assert preflight.in_flags("sse_ping_s must be >= 0") == "--sse-ping-seconds must be >= 0"
    assert preflight.in_flags("port must be in 1..65535, got 0") == "--port must be in 1..65535, got 0"
    # one-word fields are English words elsewhere in a message
    words = "a draft of the served model's own weights as --draft-quantization int4 is the served model itself"
    assert preflight.in_flags(words) == words


def test_a_served_model_name_must_be_a_name(capsys):
    parser = options_table.serve_parser()
    assert parser.parse_args(["--served-model-name", "my model"]).served_model_name == ["my model"]
    assert parser.parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]  # vLLM takes several
    for bad in ("", "  ", "two\nlines"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--served-model-name", bad])
        assert "is not a model name" in capsys.readouterr().err


def test_the_embedded_models_name_is_the_loaders():
    from kvserve.engine.loader import DEFAULT_MODEL

    assert preflight.EMBEDDED_MODEL == DEFAULT_MODEL


def test_model_paths_are_checked_before_loading(tmp_path):
    check = preflight.model_path_problem
    assert check("--model", None) is None and check("--model", "smollm2") is None
    assert check("--model", str(tmp_path / "nope")) == f"--model {tmp_path / 'nope'}: no such file or directory"
    assert "looks like a model hub id: kvserve never downloads" in check("--model", "HuggingFaceTB/SmolLM2-135M")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "a file, but not a GGUF file" in check("--model", str(text))
    gguf = tmp_path / "m.bin"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert "its name does not end in .gguf" in check("--model", str(gguf))
    (tmp_path / "a-partial-download.gguf").write_bytes(b"")  # sorts first: the hint must skip it
    gguf = gguf.rename(tmp_path / "m.gguf")
    assert check("--model", str(gguf)) is None
    assert check("--model", str(tmp_path)) == (f"--model {tmp_path}: a directory without config.json, so not a Hugging "
                                               f"Face model directory (kvserve never downloads); it holds a GGUF file: "
                                               f"--model {gguf}")
    (tmp_path / "config.json").write_text("{}")
    assert check("--model", str(tmp_path)) is None
    if os.geteuid() != 0:  # root reads everything
        (tmp_path / "config.json").chmod(0)
        assert "config.json cannot be read" in check("--model", str(tmp_path))


def test_flags_that_cannot_work_together_are_reported_before_loading(tmp_path, monkeypatch):
    from kvserve.engine import options

    (tmp_path / "config.json").write_text("{}")
    assert preflight.flags_problem(ServeConfig(model=str(tmp_path), quantization="gguf")).startswith(
        f"--quantization gguf serves a GGUF file's own blocks, and --model {tmp_path} is not a .gguf file")
    assert preflight.flags_problem(ServeConfig(quantization="gguf")) is None  # the embedded model is one
    monkeypatch.setattr(options, "cuda_present", lambda: False)
    assert preflight.flags_problem(ServeConfig(device="cuda")).startswith("--device cuda, but this machine has no")
    assert preflight.flags_problem(ServeConfig()) is None


def test_a_port_in_use_is_reported_before_loading(monkeypatch, caplog):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(serve, "build_state", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert kvserve_main(["serve", "--port", str(port)]) == 2
    assert f"cannot start: --port {port}: 127.0.0.1:{port} is already in use" in caplog.text
    caplog.clear()
    assert kvserve_main(["serve", "--host", "203.0.113.9"]) == 2  # TEST-NET-3: never this machine's
    assert "cannot start: --host 203.0.113.9: cannot listen there" in caplog.text
    caplog.clear()
    assert kvserve_main(["serve", "--port", "0"]) == 2
    assert "invalid option: --port must be in 1..65535, got 0" in caplog.text


def test_memory_and_key_options_that_cannot_work_are_refused_before_loading(monkeypatch, caplog, tmp_path):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(serve, "build_state", no_loading)
    refused = {("--kv-cache-memory", "0"): "invalid option: --kv-cache-memory '0' is no memory",
               ("--kv-cache-memory", "0.5"): "invalid option: --kv-cache-memory '0.5' is no memory",
               ("--kv-cache-memory=",): "invalid option: --kv-cache-memory: cannot parse memory size ''",
               ("--metrics-require-key",): "invalid option: --metrics-require-key needs API keys to ask for: give "
                                           "--api-key, --api-key-file or --admin-key too"}
    for argv, message in refused.items():
        caplog.clear()
        assert kvserve_main(["serve", *argv]) == 2, argv
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and errors[0].startswith(message), errors  # one line, naming the option
    assert ServeConfig(metrics_require_key=True, api_keys=("k",)).metrics_require_key  # with a key it is fine
    # both sizes given: the block count wins, as vLLM's --num-gpu-blocks-override, and the log says so once
    missing = str(tmp_path / "missing")  # stops the start after the options, before loading
    for argv, said in ((["--num-kv-blocks", "10", "--kv-cache-memory", "2GiB"], 1), (["--num-kv-blocks", "10"], 0)):
        caplog.clear()
        assert kvserve_main(["serve", "--model", missing, *argv]) == 2
        overrides = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
        assert overrides == ["--num-kv-blocks 10 overrides --kv-cache-memory 2GiB: the KV pool is 10 blocks, whatever "
                             "they take (as vLLM's --num-gpu-blocks-override overrides its memory budget)"][:said]


def test_ctrl_c_at_any_point_of_the_cli_ends_the_process_by_sigint(monkeypatch):
    """A KeyboardInterrupt anywhere under main (here while the parser imports a subcommand's module) ends the
    process by SIGINT at its default action, as an unhandled one would, without Python's traceback."""
    import os
    import signal

    from kvserve.server import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    killed = []
    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig, signal.getsignal(signal.SIGINT))))
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main(["serve"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert killed == [(os.getpid(), signal.SIGINT, signal.SIG_DFL)]


def test_a_kv_pool_without_room_for_one_block_names_the_options_to_change():
    from kvserve.kvcache.sizing import KVShape
    from kvserve.server.state import _num_blocks

    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, bytes_per_element=4)  # 46,080 bytes a token
    assert _num_blocks(ServeConfig(kv_cache_memory="1MiB", block_size=16), shape, None) == 2**20 // (46_080 * 16)
    with pytest.raises(ValueError) as caught:
        _num_blocks(ServeConfig(block_size=100_000), shape, None)
    assert str(caught.value) == ("--kv-cache-memory 1GiB (1,073,741,824 bytes) holds not one block of the KV pool: "
                                 "--block-size 100000 tokens x 46,080 bytes/token = 4,608,000,000 bytes; raise "
                                 "--kv-cache-memory or lower --block-size")


def test_a_missing_model_fails_in_about_a_second_without_importing_torch(tmp_path):
    code = ("import sys; from kvserve.server.cli import main; rc = main(['serve', '--model', sys.argv[1]]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"cannot start: --model {tmp_path / 'missing'}: no such file or directory" in done.stderr
    assert done.stdout.strip() == "False"  # nothing heavy was imported, so nothing was loaded


def test_the_readmes_options_table_is_the_parsers():
    """README.md's options table is generated from the parser: `python -m kvserve.server.options_table --write`
    rewrites it after a flag changes, and this test fails until it is run."""
    readme = (ROOT / "README.md").read_text()
    assert options_table.replace_table(readme, options_table.markdown(options_table.serve_parser())) == readme, (
        "README.md's options table differs from `kvserve serve --help`: run "
        "`.venv/bin/python -m kvserve.server.options_table --write`")
    table = options_table.markdown(options_table.serve_parser())
    for flag in ("--api-key-file", "--share-cache-across-keys", "--max-prompts-per-request"):
        assert f"`{flag}" in table
    assert "| `--port PORT` | `8000` | the TCP port to listen on |" in table


def test_the_command_is_offline_before_any_subcommand_imports_the_hub_libraries():
    """huggingface_hub and transformers read HF_HUB_OFFLINE once, at import, and the server's routes import them
    before the model loader: `kvserve` sets it first thing (unless the environment says otherwise)."""
    code = ("import os, sys; from kvserve.server.cli import main; main(['plan', '--json']); "
            "print(os.environ.get('HF_HUB_OFFLINE'), 'huggingface_hub' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "1 False"
