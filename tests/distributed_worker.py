"""One rank of the multi-process checks in test_distributed.py, run under torchrun:

    torchrun --nproc_per_node 2 tests/distributed_worker.py {tp,fsdp,dtensor} {cpu,cuda} TMPDIR

``tp``: a tiny model of each family loaded with transformers' ``tp_plan="auto"``, then
kernelized; its logits (inference) and parameter gradients (training) must match the
single-process eager model, and our kernels must have run. ``fsdp``: a few AdamW steps of
a kernelized model under FSDP2 ``fully_shard`` must give eager FSDP2's losses.
``dtensor``: ``geglu`` on DTensors (its sharding rule) against float64, and the GEMM
functions' error for a DTensor. On the CPU
(gloo, Triton interpreter) inference runs in fp16, so the TP path takes the dual GEMM;
on GPUs (NCCL) everything runs in bf16. Any mismatch raises, so the rank exits non-zero.
"""

import copy
import os
import sys
from dataclasses import replace
from pathlib import Path

DEVICE = sys.argv[2]
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import torch.distributed as dist
from kernels import (
    LocalLayerRepository,
    Mode,
    get_local_kernel,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from transformers import (
    DistributedConfig,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
)
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

ROOT = Path(__file__).resolve().parent.parent
TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 136,  # 68 features per rank: a multiple of no tile size
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "gemma": (GemmaConfig, GemmaForCausalLM, {"hidden_act": "gelu_pytorch_tanh"}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"hidden_activation": "gelu_pytorch_tanh"},
    ),
}
replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
replace_kernel_forward_from_hub(Gemma3MLP, "GeGLUMLP")


def kernelized(model, mode: Mode):
    mapping = {"GeGLUMLP": {DEVICE: LocalLayerRepository(ROOT, layer_name="GeGLUMLP")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        return kernelize(model, mode=mode, device=DEVICE)


def our_ops_called(run) -> dict[str, int]:
    """``run()`` under the profiler: how often each of our ops ran (their names carry the
    build's namespace, ``_fused_geglu_<backend>_<hash>::<op>``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        run()
    return {
        e.key.split("::")[-1]: e.count
        for e in p.key_averages()
        if e.key.startswith("_fused_geglu")
    }


def tolerance(dtype: torch.dtype) -> dict:
    return (
        {"rtol": 1e-4, "atol": 1e-4}
        if dtype == torch.float32
        else {"rtol": 3e-2, "atol": 3e-2}
    )


def save_tiny(family: str, tmp: Path) -> Path:
    config_cls, model_cls, act = FAMILIES[family]
    path = tmp / family
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = config_cls(**TINY, **act)
        model_cls(config).save_pretrained(path)
    dist.barrier()
    return path


def with_mlp_outputs(model, run) -> tuple:
    """``run()``'s result, and each decoder layer's MLP output (float) during it."""
    outputs = []
    hooks = [
        layer.mlp.register_forward_hook(lambda m, i, out: outputs.append(out.float()))
        for layer in model.model.layers
    ]
    try:
        return run(), outputs
    finally:
        for hook in hooks:
            hook.remove()


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().square().mean()


def full_grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
        for n, p in model.named_parameters()
    }


def check_tp(family: str, tmp: Path, device: torch.device) -> None:
    _, model_cls, _ = FAMILIES[family]
    path = save_tiny(family, tmp)
    ids = torch.randint(
        0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1)
    ).to(device)
    layers = TINY["num_hidden_layers"]
    # use_kernels=False on the CUDA loads: transformers (5.25 on) kernelizes them with the
    # Hub's kernels by default, which needs the network; only our MLP layers are compared.
    tp = DistributedConfig(tp_plan="auto")

    # Inference, 16-bit: the TP layer runs the dual GEMM on the local weight shards.
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    eager = model_cls.from_pretrained(path, dtype=dtype).to(device).eval()
    model = kernelized(
        model_cls.from_pretrained(
            path, dtype=dtype, distributed_config=tp, use_kernels=False
        ).eval(),
        Mode.INFERENCE,
    )
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.gate_proj.weight, DTensor), "the model is not tensor-parallel"
    with torch.no_grad():
        calls = our_ops_called(lambda: model(ids))
        (expected, expected_mlps), (logits, mlps) = (
            with_mlp_outputs(m, lambda m=m: m(ids).logits) for m in (eager, model)
        )
    assert calls == {"geglu_linear": layers}, f"{family} TP inference ran {calls}"
    torch.testing.assert_close(logits, expected, **tolerance(dtype))
    # The MLPs' share of the logits is small: check their outputs on their own too
    # (fp16 differs by 0.15% of the largest output; 5% larger weights make that 10%).
    share = 0.01 if dtype == torch.float16 else 0.03
    for out, ref in zip(mlps, expected_mlps, strict=True):
        torch.testing.assert_close(
            out, ref, rtol=0, atol=ref.abs().max().item() * share
        )

    # Training: projections through the TP modules (DTensor math), our fused activation.
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    eager = model_cls.from_pretrained(path, dtype=dtype).to(device)
    model = kernelized(
        model_cls.from_pretrained(
            path, dtype=dtype, distributed_config=tp, use_kernels=False
        ),
        Mode.TRAINING,
    )
    expected = eager(ids).logits
    loss_of(expected).backward()
    calls = our_ops_called(lambda: loss_of(model(ids).logits).backward())
    assert calls.get("geglu") == layers, f"{family} TP training ran {calls}"
    model.zero_grad()
    logits = model(ids).logits
    loss_of(logits).backward()
    torch.testing.assert_close(logits, expected, **tolerance(dtype))
    want, got = full_grads(eager), full_grads(model)
    for name in want:
        torch.testing.assert_close(
            got[name],
            want[name],
            **tolerance(dtype),
            msg=lambda m, name=name: f"{family} grad {name}: {m}",
        )


def fsdp_sharded(model):
    """FSDP2 as its docs advise: each decoder layer, then the root."""
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def check_tp_styles(device: torch.device) -> None:
    """The layers take a projection's local shards (and skip its forward) for transformers'
    "colwise" style only, and those shards reproduce its forward; every other style keeps
    its own forward and collectives."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    fused_geglu = get_local_kernel(ROOT)
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(device)
    for name in (
        "colwise",
        "colwise_rep",
        "colwise_gather_output",
        "rowwise",
        "replicate",
    ):
        torch.manual_seed(4)  # the same full weight on every rank
        linear = torch.nn.Linear(64, 136).to(device)
        style = ALL_PARALLEL_STYLES[name]
        for param in ("weight", "bias"):
            style.shard_param(linear, param, mesh)
        style.install_forward(linear, mesh)
        shards = fused_geglu.module_route._tp_colwise_shards(linear)
        assert (shards is not None) == (name == "colwise"), name
        if shards is not None:
            with torch.no_grad():
                torch.testing.assert_close(
                    torch.nn.functional.linear(x, *shards), linear(x)
                )


def check_fsdp(family: str, device: torch.device) -> None:
    config_cls, model_cls, act = FAMILIES[family]
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(0)  # the same initial weights on every rank
    base = model_cls(config_cls(**TINY, **act)).to(device, dtype)

    def train(model) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batch
        losses = []
        for _ in range(4):
            ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=data)
            loss = model(ids.to(device), labels=ids.to(device)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    expected = train(fsdp_sharded(copy.deepcopy(base)))
    model = fsdp_sharded(kernelized(copy.deepcopy(base), Mode.TRAINING))
    ids = torch.randint(0, TINY["vocab_size"], (2, 12)).to(device)
    calls = our_ops_called(lambda: model(ids, labels=ids).loss.backward())
    assert calls.get("geglu") == TINY["num_hidden_layers"], (
        f"{family} FSDP2 ran {calls}"
    )
    model.zero_grad()
    losses = train(model)
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(expected), rtol=rtol, atol=0
    )


def check_dtensor(device: torch.device) -> None:
    """``geglu`` on DTensors, every placement (the two inputs alike, then mixed, which
    DTensor redistributes), forward and backward against float64 on the full tensors."""
    fused_geglu = get_local_kernel(ROOT)
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(2)
    gate, up, dout = (torch.randn(4, 6, 10, generator=gen) for _ in range(3))
    gate64, up64 = (t.double().requires_grad_() for t in (gate, up))
    want = torch.nn.functional.gelu(gate64, approximate="tanh") * up64
    want.backward(dout.double())
    placements = [Replicate(), Shard(0), Shard(1), Shard(2)]
    for gate_p, up_p in [(p, p) for p in placements] + [(Shard(0), Replicate())]:
        g = distribute_tensor(gate.to(device), mesh, [gate_p]).requires_grad_()
        u = distribute_tensor(up.to(device), mesh, [up_p]).requires_grad_()
        out = fused_geglu.geglu(g, u, "tanh")
        assert isinstance(out, DTensor), type(out)
        out.backward(distribute_tensor(dout.to(device), mesh, out.placements))
        for got, expected in ((out, want), (g.grad, gate64.grad), (u.grad, up64.grad)):
            torch.testing.assert_close(
                got.full_tensor().double().cpu(),
                expected.detach(),
                rtol=1e-5,
                atol=1e-6,
            )
    x = distribute_tensor(gate.to(device), mesh, [Shard(0)])
    try:
        fused_geglu.linear(x, torch.randn(3, 10, device=device))
    except TypeError as e:
        assert "x is a DTensor" in str(e) and "to_local" in str(e), e
    else:
        raise AssertionError("linear accepted a DTensor")


def main() -> None:
    check, tmp = sys.argv[1], Path(sys.argv[3])
    if DEVICE == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    # Tiny models: their training calls take our kernels as large ones do (conftest's
    # _training_kernels_at_every_size, for this process).
    tuning = get_local_kernel(ROOT).tuning
    every_size = replace(tuning.table(device), training_kernel_min_elements=0)
    tuning.set_table(device, every_size)
    # Each check: (what its line says, the function); every rank prints "<line> ok".
    checks = {
        "tp": [(f"tp {f}", lambda f=f: check_tp(f, tmp, device)) for f in FAMILIES]
        + [("tp styles", lambda: check_tp_styles(device))],
        "fsdp": [(f"fsdp {f}", lambda f=f: check_fsdp(f, device)) for f in FAMILIES],
        "dtensor": [("dtensor", lambda: check_dtensor(device))],
    }
    try:
        for line, run in checks[check]:
            run()
            print(f"rank {dist.get_rank()}: {line} ok", flush=True)
        # Both ranks done before either tears down: a rank whose peer had already exited
        # aborted in gloo's teardown ("terminate called without an active exception").
        # Not after a failure: the other rank may be waiting in another collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed. The interpreter's teardown can still abort a rank (gloo,
    # "terminate called without an active exception": threads that outlive the process
    # group, pytorch/pytorch#179291): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
