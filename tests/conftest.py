"""Session fixtures: the real SmolLM2 (loaded once, float32) and a live server on 127.0.0.1."""

from __future__ import annotations

import copy

import pytest

from kvserve.server.config import ServeConfig
from tests.engineutil import Served
from tests.serverutil import running_server


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct in float32 on CPU, wired to paged attention. Never mutate it."""
    from kvserve.engine.loader import Device, DType, load_model

    return load_model(None, DType.FLOAT32, Device.CPU)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The embedded SmolLM2 as ``kvserve serve`` serves it by default: the GGUF's own Q4_1/Q8_0 blocks, float32
    activations, on CPU. Never mutate it."""
    from kvserve.engine import weights
    from kvserve.engine.loader import Device, DType, load_model
    from kvserve.quant.options import Scheme

    loaded = load_model(None, DType.AUTO, Device.CPU, quantized=True, blocks=True)
    weights.apply(loaded, Scheme.GGUF, None)
    return loaded


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``make(shape, mix)``: the path of a tiny GGUF file of ``python -m kvserve.loadtest randgguf`` (a shape of
    its SHAPES, a mixture of its MIXES; seeded, so its tokenizer's cache entry is reused), written once per
    session."""
    from kvserve.loadtest.fixtures.randgguf import SHAPES, write

    root, made = tmp_path_factory.mktemp("gguf"), {}

    def make(shape: str, mix: str = "Q4_K_M"):
        if (shape, mix) not in made:
            made[shape, mix] = write(SHAPES[shape], mix, root / f"{shape}-{mix.lower()}.gguf")
        return made[shape, mix]
    return make


@pytest.fixture(scope="module", params=["float32", "gguf"])
def served(request):
    """Each weight format ``kvserve serve`` picks by default for the embedded model, in turn: full precision
    (``smollm2``) and the GGUF's own blocks (``smollm2_gguf``, --quantization auto). Never mutate it."""
    return request.getfixturevalue({"float32": "smollm2", "gguf": "smollm2_gguf"}[request.param])


@pytest.fixture(scope="session")
def server_url(smollm2):
    """Base URL of a live server on SmolLM2 with the default configuration (256 MiB KV pool)."""
    with running_server(smollm2, ServeConfig(kv_cache_memory="256MiB")) as url:
        yield url


@pytest.fixture(scope="session")
def served_model(request, smollm2):
    """SmolLM2 in one configuration of ``tests.engineutil.SERVED`` (parametrize ``served_model`` indirectly);
    skipped where this CPU lacks the dtype. Loaded once per configuration per session. Never mutate it."""
    import torch

    from kvserve.engine.loader import Device, DType, cpu_has_bf16, load_model, serves_bf16_kernel
    from kvserve.quant.model import quantize_for_serving
    from kvserve.quant.options import Scheme

    served: Served = request.param
    if served.dtype is DType.BFLOAT16 and not cpu_has_bf16():
        pytest.skip("this CPU has no native bfloat16 (AVX-512 BF16 or AMX): kvserve serve does not pick it here")
    if served.dtype is DType.AUTO and not serves_bf16_kernel(DType.AUTO, torch.device("cpu")):
        pytest.skip("the AVX512-BF16 kernel does not run here (no AVX512-BF16, or KVSERVE_ISA forces a lesser path): "
                    "--quantization none serves float32, which the float32 configuration covers")
    if served.dtype is DType.FLOAT32 and served.quantization is Scheme.NONE:
        return smollm2
    if served.quantization is Scheme.GGUF:  # the default: the file's own blocks, loaded once per session
        return request.getfixturevalue("smollm2_gguf")
    if served.quantization is Scheme.NONE:
        return load_model(None, served.dtype, Device.CPU)
    loaded = copy.deepcopy(smollm2)
    quantize_for_serving(loaded.model, served.quantization)
    return loaded
