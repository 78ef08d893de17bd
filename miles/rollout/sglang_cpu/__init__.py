"""miles' CPU compatibility layer for the processes of an SGLang server: see :mod:`miles.rollout.sglang_cpu.sitecustomize`."""
