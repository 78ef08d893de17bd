"""The GPU path without Ray: the torch engine, the FSDP and Megatron trainers (NCCL) and CUDA IPC weight sync
on one device.

Marked ``gpu`` (skipped without CUDA); ``scripts/gpu_check.sh`` runs them on a GPU machine. Not yet run
on a GPU: until they have, the README calls the GPU paths untested.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from fsdp_ranks import free_port, hf_model_from, rl_batch

from miles.backends.contract import check_engine, check_trainer
from miles.config import RankConfig
from miles.config.schema import PrecisionConfig
from miles.config.validate import validate
from miles.rollout.torch_engine import TorchEngine
from miles.train.fsdp import FSDPTrainer
from miles.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.gpu


def _greedy(engine: TorchEngine) -> list:
    reqs = [GenerateRequest(request_id=f"g{i}", prompt_ids=tuple(range(3 + i, 9 + 2 * i))) for i in range(4)]
    return engine.generate(reqs, SamplingParams(greedy=True, max_new_tokens=8))


def test_engine_on_cuda_matches_the_cpu_engine_and_meets_its_contract(tiny_qwen3_dir: Path) -> None:
    cpu = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig(), max_batch_size=8)
    gpu = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig(), max_batch_size=8, device="cuda")
    try:
        for a, b in zip(_greedy(cpu), _greedy(gpu), strict=True):
            assert a.response_ids == b.response_ids
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        check_engine(gpu, dict(hf_model_from(tiny_qwen3_dir).state_dict()))
    finally:
        cpu.close()
        gpu.close()


def _gradients(ckpt: Path, device: str) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    trainer = FSDPTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                          checkpoint_dir=str(ckpt), config=RankConfig.of(validate({})), device=device)
    try:
        batch = rl_batch(hf_model_from(ckpt))
        return trainer.compute_gradients(batch), trainer.compute_logprobs(batch)
    finally:
        trainer.shutdown()


def test_fsdp_trainer_on_cuda_computes_what_it_computes_on_cpu(tiny_qwen3_dir: Path) -> None:
    cpu_grads, cpu_logps = _gradients(tiny_qwen3_dir, "cpu")
    gpu_grads, gpu_logps = _gradients(tiny_qwen3_dir, "cuda")
    torch.testing.assert_close(torch.tensor(sum(gpu_logps, [])), torch.tensor(sum(cpu_logps, [])), atol=1e-4, rtol=0)
    for k, g in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[k], g, atol=1e-5, rtol=1e-3, msg=k)
    trainer = FSDPTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                          checkpoint_dir=str(tiny_qwen3_dir),
                          config=RankConfig.of(validate({"algo": {"num_minibatches": 2}})),
                          device="cuda")
    try:
        model = hf_model_from(tiny_qwen3_dir)
        check_trainer(trainer, rl_batch(model), dict(model.state_dict()))
    finally:
        trainer.shutdown()


def _engine_receives(ckpt: str, queue: mp.Queue, result: mp.Queue) -> None:
    from miles.weights.ipc import IpcReceiver

    engine = TorchEngine(ckpt, PrecisionConfig(), max_batch_size=4, device="cuda")
    engine.update_weights_from(IpcReceiver(queue.get(timeout=120)), 1)
    result.put({k: v.cpu() for k, v in engine.state_dict().items()})
    engine.close()


def test_ipc_handles_carry_the_weights_to_an_engine_in_another_process(tiny_qwen3_dir: Path) -> None:
    from miles.weights.ipc import IpcSender

    torch.cuda.init()
    g = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(v.shape, generator=g) for k, v in hf_model_from(tiny_qwen3_dir).state_dict().items()}
    ctx = mp.get_context("spawn")
    queue, result = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_engine_receives, args=(str(tiny_qwen3_dir), queue, result))
    child.start()
    sent = IpcSender().send({k: v.cuda() for k, v in sd.items()}, 1)
    queue.put(sent.handle)
    got = result.get(timeout=300)
    child.join(60)
    assert child.exitcode == 0
    for k, v in sd.items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0, msg=k)


def test_megatron_tp1_on_cuda_computes_what_fsdp_computes_on_cpu(tiny_qwen3_dir: Path) -> None:
    pytest.importorskip("megatron.core")
    from miles.train.megatron import MegatronTrainer

    cpu_grads, cpu_logps = _gradients(tiny_qwen3_dir, "cpu")
    run = validate({"trainer": {"_target_": "miles.train.megatron.MegatronTrainer", "shared_prompt_forward": False}})
    trainer = MegatronTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                              checkpoint_dir=str(tiny_qwen3_dir), config=RankConfig.of(run), num_threads=1,
                              device="cuda")
    try:
        model = hf_model_from(tiny_qwen3_dir)
        batch = rl_batch(model)
        logps = trainer.compute_logprobs(batch)
        torch.testing.assert_close(torch.tensor(sum(logps, [])), torch.tensor(sum(cpu_logps, [])), atol=1e-4, rtol=0)
        grads = trainer.compute_gradients(batch)
        for k, g in cpu_grads.items():
            torch.testing.assert_close(grads[k], g, atol=1e-5, rtol=1e-3, msg=k)
        check_trainer(trainer, batch, dict(model.state_dict()))
    finally:
        trainer.shutdown()
