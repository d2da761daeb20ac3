"""Kernelized against eager on two GPUs (NCCL), a Gemma-2B-sized model in bf16: tensor
parallel (transformers' ``tp_plan="auto"``) forward and training step, FSDP2
(``fully_shard`` per decoder layer) training step. Run on a 2-GPU machine:

    torchrun --nproc_per_node 2 benchmarks/distributed.py --out results.json

Times are medians over ``--steps`` CUDA-event-timed calls after warm-up, taken on rank 0
(the ranks synchronise through their collectives); peak memory is rank 0's.
"""

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path

import bench_lib as lib
import torch
import torch.distributed as dist
from kernels import (
    LocalLayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)
from torch.distributed.fsdp import fully_shard
from transformers import DistributedConfig, GemmaConfig, GemmaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaMLP

ROOT = Path(__file__).resolve().parent.parent
# Gemma-2B's layer shapes (hidden 2048, intermediate 16384, 8 heads of 256) with 8 of its
# 18 layers, and 2 key/value heads instead of 1 so that they shard over 2 ranks.
CONFIG = {
    "vocab_size": 256000,
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
}
replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")


def kernelized(model, mode: Mode):
    mapping = {"GeGLUMLP": {"cuda": LocalLayerRepository(ROOT, layer_name="GeGLUMLP")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        return kernelize(model, mode=mode, device="cuda")


def timed(fn, steps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    return {"ms": statistics.median(times), "peak_extra_MiB": peak / 2**20}


def training_step(model, ids):
    # Not foreach: a TP model mixes DTensor and plain parameters, which the fused
    # multi-tensor kernels refuse.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)

    def step():
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def compare(name: str, make_model, run, steps: int) -> dict:
    """``run(make_model(kernelize_it))``'s timing, eager then kernelized."""
    row = {}
    for label, kernelize_it in (("eager", False), ("kernelized", True)):
        model = make_model(kernelize_it)
        row[label] = timed(run(model), steps)
        del model
        torch.cuda.empty_cache()
    row["speedup"] = row["eager"]["ms"] / row["kernelized"]["ms"]
    if dist.get_rank() == 0:
        print(name, json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    lib.require_cuda("benchmarks/distributed.py")
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = GemmaConfig(**CONFIG)
    ids = torch.randint(0, CONFIG["vocab_size"], (args.batch, args.seq), device=device)
    result = {
        "env": lib.environment() | {"world_size": dist.get_world_size()},
        "model": {**CONFIG, "dtype": "bfloat16", "tokens_per_rank": ids.numel()},
    }
    with tempfile.TemporaryDirectory() as own_tmp:
        tmp = [own_tmp]  # rank 0's directory, the checkpoint every rank loads
        dist.broadcast_object_list(tmp)
        tmp = tmp[0]
        if rank == 0:
            torch.manual_seed(0)
            GemmaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        dist.barrier()

        def tp_model(mode: Mode):
            def make(kernelize_it):
                model = GemmaForCausalLM.from_pretrained(
                    tmp,
                    dtype=torch.bfloat16,
                    distributed_config=DistributedConfig(tp_plan="auto"),
                    use_kernels=False,
                )
                return kernelized(model, mode) if kernelize_it else model

            return make

        def forward(model):
            model.eval()

            def run():
                with torch.no_grad():
                    model(ids)

            return run

        result["tp_forward"] = compare(
            "tp_forward", tp_model(Mode.INFERENCE), forward, args.steps
        )
        result["tp_training_step"] = compare(
            "tp_training_step",
            tp_model(Mode.TRAINING),
            lambda m: training_step(m.train(), ids),
            args.steps,
        )
        dist.barrier()

    torch.manual_seed(0)
    with device:
        base = GemmaForCausalLM(config).to(torch.bfloat16)

    def fsdp_model(kernelize_it):
        model = copy.deepcopy(base)
        if kernelize_it:
            model = kernelized(model, Mode.TRAINING)
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)

    result["fsdp_training_step"] = compare(
        "fsdp_training_step",
        fsdp_model,
        lambda m: training_step(m.train(), ids),
        args.steps,
    )
    if rank == 0:
        print(json.dumps(result, indent=1), flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
