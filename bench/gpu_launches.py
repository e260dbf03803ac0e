"""Kernel launches per decode step and decoder layer on the CUDA code path, counted on a CPU.

The engine runs the backends auto picks on CUDA (`cuda_spec`: Triton kernels where the backend
has them, torch ops elsewhere) under Triton's interpreter (`TRITON_INTERPRET=1`, set here before
anything imports triton) on a tiny random-weight bfloat16 checkpoint of each family
(`transformers.AutoModelForCausalLM.from_config`, saved to a temporary directory). One decode
step of `--batch` requests (after their prefill step) is counted:

- every Triton kernel launch (`InterpretedFunction.run` / `JITFunction.run`: one per grid), and
- every torch op that would launch a CUDA kernel, seen by a `TorchDispatchMode`: every aten op
  except the view, metadata and allocation ops of `NON_LAUNCH_OPS` (on CUDA `torch.empty` is an
  allocation from the caching allocator, no kernel; `torch.zeros`, `full`, `arange`, copies and
  `.item()` are launches; an op that returns its input's own tensor, such as `.to(dtype)` of a
  tensor already of that dtype, is none). Torch ops run inside a Triton launch (the
  interpreter's own argument copies) are not counted.

Each launch is attributed to the decoder layer whose forward is running (forward hooks on every
module of the model, a stack of module names) and to a part of it: attention (`self_attn`),
norms (the layer's two norms, with the residual adds fused into them: the input norm adds the
previous layer's MLP output, vLLM's `RMSNorm(x, residual)`), moe (the `FusedMoE` block; split
into router, align, experts, shared experts and the rest), mlp (a dense layer's MLP), residual
(the layer's own adds, where a norm does not take them).
Launches outside the layers (embedding, final norm, LM head, sampler, step inputs) are one
total: on a CPU the step inputs are built with torch ops that CUDA does on the host, so that
number is not the GPU's.

    python bench/gpu_launches.py                       # every family, batch 1 and 8
    python bench/gpu_launches.py --family qwen3_moe --batch 1 --list
    python bench/gpu_launches.py --json

Issue 42's target: at most 16 launches per MoE decoder layer, attention included, for Qwen3-MoE
and gpt-oss, and at most 20 for DeepSeek-V3 (MLA, shared experts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: aten ops (overload packets) that launch no CUDA kernel: views, metadata and allocations.
NON_LAUNCH_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    "view", "_unsafe_view", "_reshape_alias", "reshape", "view_as", "as_strided", "t",
    "transpose", "permute", "slice", "select", "unsqueeze", "squeeze", "expand", "expand_as",
    "detach", "alias", "split", "split_with_sizes", "unbind", "narrow", "chunk", "unflatten",
    "diagonal", "lift_fresh", "view_as_real", "view_as_complex", "_conj", "conj", "set_",
    "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
})  # fmt: skip

_COMMON = {
    "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_experts_per_tok": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.5,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip
#: Tiny configs per family: every layer MoE but DeepSeek-V3's first (dense, as the real one).
FAMILIES: dict[str, dict] = {
    "qwen3_moe": {"num_hidden_layers": 2, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "num_experts": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "gpt_oss": {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 8,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                "swiglu_limit": 7.0},
    "deepseek_v3": {"num_hidden_layers": 2, "num_key_value_heads": 4, "intermediate_size": 96,
                    "moe_intermediate_size": 32, "n_routed_experts": 16,
                    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                    "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 48,
                    "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "head_dim": 16, "rope_interleave": True},
    "mixtral": {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 8},
}  # fmt: skip
#: Issue 42's ceiling of launches per MoE decoder layer, attention included.
TARGETS = {"qwen3_moe": 16, "gpt_oss": 16, "deepseek_v3": 20, "mixtral": 16}
PARTS = (
    "attention",
    "norms",
    "router",
    "align",
    "experts",
    "shared",
    "moe_other",
    "mlp",
    "residual",
)
#: The parts of a MoE layer's `FusedMoE` block (its `moe_block` column).
MOE_BLOCK_PARTS = ("router", "align", "experts", "shared", "moe_other")
#: Functions whose launches are the MoE block's routing / alignment (by name on the stack).
_ROUTER_FUNCS = frozenset(
    {
        "_route",
        "softmax_topk",
        "topk_softmax",
        "sigmoid_grouped_topk",
        "softmax_grouped_topk",
        "router_topk",
    }
)


@dataclass
class Launch:
    """One counted launch: `op` ("triton:<kernel>" or an aten op), its decoder layer (-1:
    outside the layers), part (one of `PARTS`, "" outside) and the innermost repository
    function that issued it ("path.py:function")."""

    op: str
    layer: int
    part: str
    where: str


@dataclass
class LayerCount:
    """Launches of one decoder layer, by part; `moe` tells a MoE layer from a dense one."""

    layer: int
    moe: bool
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


class LaunchCounter(TorchDispatchMode):
    """Counts launches (see the module docstring) while active, attributed through the module
    stack kept by `attach`'s hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[Launch] = []
        self.stack: list[tuple[str, torch.nn.Module]] = []  # (path, module)
        self.moe_layers: set[int] = set()
        self._in_triton = 0
        self._hooks: list = []

    # -------------------------------------------------------------- module stack
    def attach(self, model: torch.nn.Module) -> None:
        """Forward pre/post hooks on every module of `model`, to know which one runs. A module
        shared by several layers (the rotary embedding) is named under the module that calls
        it (its parent on the stack), not by its first name in `named_modules`."""
        from moe_engine.models.layers.moe import FusedMoE

        self._child_names: dict[tuple[int, int], str] = {}
        for name, module in model.named_modules():
            for child_name, child in module.named_children():
                self._child_names[(id(module), id(child))] = child_name
            if isinstance(module, FusedMoE):
                self.moe_layers.add(_layer_of(name))
            self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
            self._hooks.append(module.register_forward_hook(self._leave))

    def _enter(self, name: str):
        def hook(module, args) -> None:
            if self.stack:
                parent_path, parent = self.stack[-1]
                child = self._child_names.get((id(parent), id(module)))
                if child is not None:
                    self.stack.append((f"{parent_path}.{child}", module))
                    return
            self.stack.append((name, module))

        return hook

    def _leave(self, module, args, output) -> None:
        self.stack.pop()

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()

    # -------------------------------------------------------------- counting
    def record(self, op: str) -> None:
        path = self.stack[-1][0] if self.stack else ""
        layer = _layer_of(path)
        where = _issuer()
        part = _part(path, layer, layer in self.moe_layers, where) if layer >= 0 else ""
        self.launches.append(Launch(op, layer, part, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if (
            not self._in_triton
            and name not in NON_LAUNCH_OPS
            and not _returns_input(name, args, out)
        ):
            self.record(name)
        return out

    def triton_launch(self, kernel_name: str):
        """A context for one Triton launch: counted once, the torch ops inside ignored."""
        counter = self

        class _Launch:
            def __enter__(self):
                counter.record(f"triton:{kernel_name}")
                counter._in_triton += 1

            def __exit__(self, *exc):
                counter._in_triton -= 1

        return _Launch()


_ACTIVE: list[LaunchCounter] = []


def _patch_triton() -> None:
    """Count every Triton launch of an active `LaunchCounter` (interpreted or compiled)."""
    from triton.runtime import interpreter, jit

    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        original = cls.run
        if getattr(original, "_counted", False):
            continue

        def run(self, *args, _original=original, **kwargs):
            if not _ACTIVE or kwargs.get("warmup"):
                return _original(self, *args, **kwargs)
            with _ACTIVE[-1].triton_launch(getattr(self.fn, "__name__", "?")):
                return _original(self, *args, **kwargs)

        run._counted = True
        cls.run = run


def _returns_input(name: str, args: tuple, out: object) -> bool:
    """Whether an out-of-place op handed back its first argument's own tensor (`.to(dtype)`
    or `.contiguous()` with nothing to do): no kernel runs. In-place ops (`add_`) do run one."""
    first = args[0] if args else None
    return (
        not name.endswith("_")
        and isinstance(first, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and out.data_ptr() == first.data_ptr()
        and out.dtype == first.dtype
        and out.shape == first.shape
        and out.stride() == first.stride()
    )


def _layer_of(path: str) -> int:
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1


def _issuer() -> str:
    """The innermost function of this repository's kernels/ or moe_engine/models/ on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        file = frame.f_code.co_filename
        if file.startswith(str(REPO)) and ("/kernels/" in file or "/models/" in file):
            return f"{Path(file).relative_to(REPO)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _stack_functions() -> set[str]:
    names, frame = set(), sys._getframe(3)
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _part(path: str, layer: int, moe: bool, where: str) -> str:
    rest = path.split(f"layers.{layer}", 1)[1].lstrip(".")
    if rest.startswith("self_attn"):
        return "attention"
    if rest.startswith(("input_layernorm", "post_attention_layernorm")):
        return "norms"
    if not rest.startswith("mlp"):
        return "residual"
    if not moe:
        return "mlp"
    if rest.startswith("mlp.shared_experts"):
        return "shared"
    if rest.startswith("mlp.gate"):
        return "router"
    funcs = _stack_functions()
    if funcs & _ROUTER_FUNCS:
        return "router"
    if "moe_align_block_size" in funcs:
        return "align"
    if funcs & {"_fused_moe", "fused_moe", "fused_moe_int4", "fused_moe_mxfp4"}:
        return "experts"
    return "moe_other"


# ------------------------------------------------------------------ the runs
def make_checkpoint(family: str, root: Path) -> Path:
    """A tiny random bfloat16 checkpoint of `family` under `root` (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / family
    if (path / "config.json").is_file():
        return path
    config = AutoConfig.for_model(family, **{**_COMMON, **FAMILIES[family]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # transformers zeroes these: draw them, so their paths run
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("e_score_correction_bias", ".sinks")) or (
                family == "gpt_oss" and name.endswith("bias")
            ):
                t.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def cuda_spec() -> str:
    """The `--kernel-backend` that picks on a CPU what auto picks on CUDA: triton for the ops
    it implements, torch for the rest (auto on a CPU would take native-cpu for those)."""
    from kernels.plan import IMPLEMENTS, OPS, TORCH, TRITON

    return ",".join([TRITON, *(f"{op}={TORCH}" for op in OPS if op not in IMPLEMENTS[TRITON])])


def count_decode_step(ckpt: Path, batch: int) -> LaunchCounter:
    """Launches of one decode step of `batch` requests (4-token prompts, prefilled first), the
    model computed in bfloat16 (`MOE_ENGINE_FORCE_BF16=1` for the build, as a GPU computes).

    Raises:
        RuntimeError: the counted step was not a decode of `batch` tokens."""
    _patch_triton()
    before = os.environ.get("MOE_ENGINE_FORCE_BF16")
    os.environ["MOE_ENGINE_FORCE_BF16"] = "1"  # compute in bf16 as a GPU does, not float32
    try:
        return _count(ckpt, batch)
    finally:
        if before is None:
            os.environ.pop("MOE_ENGINE_FORCE_BF16")
        else:
            os.environ["MOE_ENGINE_FORCE_BF16"] = before


def _count(ckpt: Path, batch: int) -> LaunchCounter:
    from moe_engine import LLM, SamplingParams

    llm = LLM(
        model=str(ckpt),
        max_model_len=64,
        max_num_seqs=batch,
        kernel_backend=cuda_spec(),
        num_blocks_override=4 * batch + 4,
        enforce_eager=True,
    )
    core = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", [3 + i, 5, 7, 11], params)
    core.step()  # the prefill
    counter = LaunchCounter()
    counter.attach(core.model)
    _ACTIVE.append(counter)
    try:
        with counter, torch.inference_mode():
            core.step()
    finally:
        _ACTIVE.pop()
        counter.detach()
    if core.last_step is None or core.last_step.num_tokens != batch:
        raise RuntimeError(f"the counted step was not a decode of {batch} tokens")
    core.close()
    return counter


def per_layer(counter: LaunchCounter) -> list[LayerCount]:
    layers: dict[int, LayerCount] = {}
    for launch in counter.launches:
        if launch.layer < 0:
            continue
        lc = layers.setdefault(
            launch.layer, LayerCount(launch.layer, launch.layer in counter.moe_layers)
        )
        lc.parts[launch.part] = lc.parts.get(launch.part, 0) + 1
    return [layers[i] for i in sorted(layers)]


def report(family: str, batch: int, counter: LaunchCounter) -> dict:
    layers = per_layer(counter)
    moe = [lc.total for lc in layers if lc.moe]
    outside = sum(1 for launch in counter.launches if launch.layer < 0)
    return {
        "family": family,
        "batch": batch,
        "target": TARGETS[family],
        "max_moe_layer": max(moe) if moe else None,
        "meets_target": bool(moe) and max(moe) <= TARGETS[family],
        "outside_layers": outside,
        "layers": [
            {"layer": lc.layer, "moe": lc.moe, "total": lc.total, **lc.parts} for lc in layers
        ],
    }


def print_table(result: dict) -> None:
    head = (
        f"{'layer':>5} {'kind':>5} "
        + " ".join(f"{p:>9}" for p in PARTS)
        + f" {'moe_block':>9} {'total':>6}"
    )
    print(
        f"\n{result['family']}  batch {result['batch']}  (target <= {result['target']} per "
        f"MoE layer; launches outside the layers: {result['outside_layers']})"
    )
    print(head)
    for row in result["layers"]:
        cells = " ".join(f"{row.get(p, 0):>9}" for p in PARTS)
        kind = "moe" if row["moe"] else "dense"
        block = sum(row.get(p, 0) for p in MOE_BLOCK_PARTS)
        print(f"{row['layer']:>5} {kind:>5} {cells} {block:>9} {row['total']:>6}")
    verdict = "meets" if result["meets_target"] else "misses"
    print(f"max per MoE layer: {result['max_moe_layer']} ({verdict} the target)")


def print_list(counter: LaunchCounter) -> None:
    grouped = Counter((x.layer, x.part, x.where, x.op) for x in counter.launches if x.layer >= 0)
    for (layer, part, where, op), n in sorted(grouped.items()):
        print(f"  layer {layer:>2} {part:>9}  {n:>3} x {op:<28} {where}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        action="append",
        help="one family (repeatable); default every one",
    )
    parser.add_argument(
        "--batch", type=int, action="append", help="decode batch size (repeatable); default 1 and 8"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--list", action="store_true", help="print each counted op of the layers with its issuer"
    )
    args = parser.parse_args(argv)
    families = args.family or list(FAMILIES)
    batches = args.batch or [1, 8]
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-launches-") as tmp:
        for family in families:
            ckpt = make_checkpoint(family, Path(tmp))
            for batch in batches:
                counter = count_decode_step(ckpt, batch)
                result = report(family, batch, counter)
                results.append(result)
                if not args.json:
                    print_table(result)
                    if args.list:
                        print_list(counter)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
