"""The fast CPU kernels (quant/qlinear.cpp), built once with torch's C++ extension tooling.

``python -m quant.kernels --build`` compiles them (the install step runs it); otherwise the first
quantized layer on CPU builds them (about a minute on 2 cores). If the build fails, layers fall back to the
pure-PyTorch reference and one warning is logged. Set ``KVSERVE_QUANT_KERNELS=0`` to force the reference.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger("kvserve.quant")

_SOURCE = Path(__file__).with_name("qlinear.cpp")
_NAME = "kvserve_qlinear"
_state: dict[str, ModuleType | None] = {}


def load(build: bool = True) -> ModuleType | None:
    """The compiled extension, or None when disabled or it cannot be built (cached after the first call).

    Args:
        build: compile if no up-to-date build exists (otherwise return None in that case).
    """
    if "module" in _state:
        return _state["module"]
    module = None
    if os.environ.get("KVSERVE_QUANT_KERNELS", "1") != "0":
        try:
            module = _compile() if build else _load_prebuilt()
        except Exception as exc:  # a missing compiler or headers: serve with the reference path
            log.warning("quant kernels unavailable (%s); using the pure-PyTorch reference", exc)
    if module is not None or build:
        _state["module"] = module
    return module


def _compile() -> ModuleType:
    from torch.utils import cpp_extension

    # -fopenmp: at::parallel_for is an inline OpenMP loop; compiled without it, it silently runs on one thread.
    return cpp_extension.load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)


def _load_prebuilt() -> ModuleType | None:
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(_NAME, verbose=False))
    if not (build_dir / f"{_NAME}.so").exists():
        return None
    return _compile()  # ninja sees the build is current and only imports it


def main(argv: list[str] | None = None) -> int:
    """``python -m quant.kernels --build``: compile the extension now and say which path it runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="compile (or check) the extension")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    module = load(build=True)
    if module is None:
        print("quant kernels: not built (the pure-PyTorch reference will be used)", file=sys.stderr)
        return 0  # the install must not fail over an optional speed-up
    print(f"quant kernels: built, {'AVX2+FMA' if module.vectorized() else 'scalar'} path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
