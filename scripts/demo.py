"""`make demo`: load the built kernel through kernels as a user would, swap its GeGLUMLP
layer into a small Gemma model with kernelize, check the logits against the eager model,
and show which kernels ran; then run the profiling report (scripts/report.py, its default
shapes) into benchmarks/out/. Exits non-zero when a check or the report fails.

Without a GPU the Triton kernels run in the Triton interpreter on the CPU: that checks the
numerics, but its timings say nothing about GPU speed."""

import copy
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_lib as lib  # first: it picks the interpreter without a GPU
import torch
from kernels import (
    LocalLayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import GemmaConfig, GemmaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaMLP

HAS_GPU, DEVICE = lib.HAS_GPU, lib.DEVICE

# Tiny on the CPU (the interpreter is slow); on a GPU, Gemma-2B-like MLPs in bfloat16.
if HAS_GPU:
    DTYPE, BATCH, SEQ = torch.bfloat16, 4, 512
    SIZES = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 16384}
    SIZES |= {"num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 256}
else:
    DTYPE, BATCH, SEQ = torch.float32, 2, 16
    SIZES = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 512}
    SIZES |= {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32}
# Logits must agree to ATOL + RTOL * max|eager logits|; bf16 allows a few ulps.
ATOL, RTOL = (1e-2, 2e-2) if DTYPE == torch.bfloat16 else (1e-4, 1e-4)


def timed(steps, label, note, fn):
    """Run ``fn``, append (label, seconds, note) to ``steps``, return its result."""
    result, ms = lib.timed(fn)
    steps.append((label, ms / 1e3, note))
    return result


def build_model():
    config = GemmaConfig(
        **SIZES,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
        hidden_act="gelu_pytorch_tanh",
    )
    with torch.device(DEVICE):
        return GemmaForCausalLM(config).to(DTYPE).eval()


def kernelized(model):
    replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
    repo = LocalLayerRepository(ROOT, layer_name="GeGLUMLP")
    # inherit_mapping=False: only our layer, nothing else is fetched from the Hub.
    with use_kernel_mapping({"GeGLUMLP": {DEVICE: repo}}, inherit_mapping=False):
        return kernelize(model, mode=Mode.INFERENCE, device=DEVICE)


def kernels_per_forward(model, ids):
    """(CPU-side ops, GPU kernels) that one forward of ``model`` runs, with counts."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if HAS_GPU else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        model(ids)
        lib.sync()
    events = prof.events()
    ops = Counter(e.name for e in events if e.device_type != DeviceType.CUDA)
    return ops, lib.kernel_counts(events, gpu=True)


def print_counts(title, counts):
    print(f"{title}: {sum(counts.values())} per forward")
    for name, count in counts.most_common():
        print(f"  {count:5d}  {name[:100]}")


def main() -> int:
    if HAS_GPU:
        print(f"GPU: {torch.cuda.get_device_name()}")
    else:
        print(
            "No GPU found: the Triton kernels run in the Triton interpreter on the CPU\n"
            "(TRITON_INTERPRET=1). This checks the numerics; CPU timings are not GPU timings."
        )
    # Layers we do not map (rotary embedding, GeluTanh) keep their forward; kernelize
    # warns about each one. Whether our layer was swapped in is checked below.
    logging.getLogger("kernels").setLevel(logging.ERROR)
    torch.manual_seed(0)
    steps = []

    fused_geglu = timed(steps, "load kernel", "get_local_kernel(build/)", lib.load_ours)
    namespace = fused_geglu._ops.ops.name
    size = (
        f"{SIZES['num_hidden_layers']} layers, hidden {SIZES['hidden_size']}, {DTYPE}"
    )
    eager = timed(steps, "build model", f"Gemma, {size}", build_model)
    ours = timed(
        steps, "kernelize", "Mode.INFERENCE", lambda: kernelized(copy.deepcopy(eager))
    )
    ids = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), device=DEVICE)
    with torch.no_grad():
        ref = timed(
            steps,
            "eager forward",
            f"first call, {BATCH}x{SEQ} tokens",
            lambda: eager(ids),
        )
        note = "first call: Triton JIT" if HAS_GPU else "Triton interpreter"
        out = timed(steps, "kernelized forward", note, lambda: ours(ids))

    mlps = [m for m in ours.modules() if isinstance(m, GemmaMLP)]
    swapped = sum(m.forward.__func__.__qualname__ == "GeGLUMLP.forward" for m in mlps)
    cpu_ops, gpu = kernels_per_forward(ours, ids)
    ops = Counter({k: n for k, n in cpu_ops.items() if k.startswith(f"{namespace}::")})
    print_counts(f"\nOur custom ops ({namespace})", ops)
    if HAS_GPU:
        print_counts("GPU kernels, kernelized model", gpu)
        print_counts("GPU kernels, eager model", kernels_per_forward(eager, ids)[1])

    diff = (out.logits.float() - ref.logits.float()).abs().max().item()
    tol = ATOL + RTOL * ref.logits.float().abs().max().item()
    n_ops = sum(ops.values())
    checks = [
        (
            f"GemmaMLP layers running GeGLUMLP.forward: {swapped}/{len(mlps)}",
            0 < swapped == len(mlps),
        ),
        (f"our ops ran: {n_ops} per forward", n_ops >= len(mlps)),
        (
            f"logits max abs diff vs eager: {diff:.2e} (tolerance {tol:.2e})",
            diff <= tol,
        ),
    ]

    print(f"\n{'step':<20} {'seconds':>8}  note")
    for label, seconds, note in steps:
        print(f"{label:<20} {seconds:8.3f}  {note}")
    print()
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")

    # In its own process, so that the first calls it times are cold.
    print("\nProfiling report (scripts/report.py)", flush=True)
    report = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py")], check=False
    )
    report_ok = report.returncode == 0
    print(f"{'PASS' if report_ok else 'FAIL'}  profiling report in benchmarks/out/")
    return 0 if report_ok and all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
