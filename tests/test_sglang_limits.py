"""What SGLang 0.5.23 cannot do on this CPU machine, shown by SGLang's own code (``-m sglang``).

One subprocess in SGLang's venv, with the environment a CPU server gets (stand-in ``libcuda``),
calls the functions a server calls at start for each feature and reports what they raise: first
without miles' CPU compatibility layer, then with it (:mod:`miles.rollout.sglang_cpu.sitecustomize`,
which every CPU server loads). No server is started: each failure here kills a server at start,
the same way, after its 35-60 s of start-up. The engine's docs name these errors.
"""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.sglang

PROBES = r'''
import json
import torch
from torch.nn import Module, Parameter

out = {}

def probe(name, fn):
    try:
        out[name] = "ok: " + str(fn())
    except BaseException as e:
        out[name] = f"{type(e).__name__}: {e}"

def online_fp8(**kwargs):
    # what --quantization fp8 / mxfp8 runs on every linear layer after loading bf16 weights
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=False, **kwargs))
    layer = Module()
    layer.weight = Parameter(torch.randn(32, 64, dtype=torch.bfloat16), requires_grad=False)
    layer.logical_widths = [32]
    method.process_weights_after_loading(layer)

def fp8_dtypes():
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    return Fp8Config.get_supported_act_dtypes()

def routed_experts_buffer():
    # what --enable-return-routed-experts allocates at start (RoutedExpertsCapturer's host cache)
    from sglang.srt.state_capturer.base import BaseHostCache

    return BaseHostCache(num_tokens=8, num_layers=2, topk_size=2, name="routed_experts", device="cpu")

def pinned():
    # what SGLang's LoRA layers allocate
    return torch.tensor([1, 2], dtype=torch.int32, pin_memory=True).pin_memory().is_pinned()

probe("routing_raw", routed_experts_buffer)
probe("pin_memory_raw", pinned)
import sitecustomize  # miles' CPU compatibility layer, as every CPU server process loads it

sitecustomize.install()
probe("routing", lambda: tuple(routed_experts_buffer().buffer.shape))
probe("pin_memory", pinned)
probe("fp8", online_fp8)
probe("mxfp8", lambda: online_fp8(use_mxfp8=True))
probe("fp8_dtypes", fp8_dtypes)
print("MILES-PROBES " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def probes() -> dict[str, str]:
    from miles.rollout.sglang_server import find_python, server_env

    py = find_python()
    env = {**server_env(py, "cpu", 1), "MILES_SGLANG_CPU_COMPAT": "0"}  # the probes install the layer midway
    out = subprocess.run([str(py), "-c", PROBES], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("MILES-PROBES ")), None)
    assert line is not None, f"the probes did not run (exit {out.returncode}):\n{out.stderr[-3000:]}"
    return json.loads(line.removeprefix("MILES-PROBES "))


def test_sglang_s_own_fp8_quantization_does_not_run_on_cpu(probes) -> None:
    """``--quantization fp8``: SGLang's CPU path needs the AMX kernels of a CPU build of sgl-kernel (not
    on PyPI), and fp32 is not one of its activation dtypes; ``mxfp8`` goes through Triton, which finds
    no GPU driver. The engine serves these recipes' weights dequantized instead (tests/test_sglang.py)."""
    assert probes["fp8"] == "AssertionError: Fp8LinearMethod on CPU requires that CPU has AMX support"
    assert probes["fp8_dtypes"] == "ok: [torch.bfloat16, torch.float16]"
    assert probes["mxfp8"].startswith("RuntimeError: 0 active drivers ([]). There should only be one.")


def test_routing_capture_and_lora_buffers_need_the_compatibility_layer(probes) -> None:
    """``--enable-return-routed-experts`` registers its host buffer with ``cudaHostRegister`` and SGLang's
    LoRA layers pin theirs: without a driver both raise the error that kills a CPU server at start.
    With miles' layer both are plain CPU memory (tests/test_sglang_lora_moe.py runs both on a server)."""
    for raw in (probes["routing_raw"], probes["pin_memory_raw"]):
        assert raw.startswith("RuntimeError: Found no NVIDIA driver on your system"), raw
    assert probes["routing"] == "ok: (8, 2, 2)"
    assert probes["pin_memory"] == "ok: False"


GPU_LIBRARIES = r'''
import importlib
import importlib.util

got = []
for name in ("flashinfer", "cutlass"):  # the CUDA kernel libraries the SGLang wheel installs
    assert importlib.util.find_spec(name) is not None, name
    try:
        importlib.import_module(name)
        got.append(name + " imported")
    except ModuleNotFoundError as e:
        got.append(str(e))
from sglang.srt.utils.common import is_flashinfer_available

got.append(f"flashinfer available: {is_flashinfer_available()}")
print("; ".join(got))
'''


def test_a_cpu_server_does_not_import_the_gpu_kernel_libraries() -> None:
    """FlashInfer and CUTLASS's DSL come with the SGLang wheel. In a process with a CPU server's environment
    (miles' layer loaded at start) they cannot be imported, which saves about 10 s of each server's start,
    and SGLang does not count FlashInfer as available."""
    from miles.rollout.sglang_server import find_python, server_env

    py = find_python()
    out = subprocess.run([str(py), "-c", GPU_LIBRARIES], env=server_env(py, "cpu", 1), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "No module named 'flashinfer' (not imported by a CPU server); "
        "No module named 'cutlass' (not imported by a CPU server); flashinfer available: False")
