"""GGUF files of a moe-engine benchmark checkpoint, for llama.cpp (`bench/llamacpp_runner.py`).

Converts the checkpoint `bench/throughput.py` benchmarks (`bench-qwen3-moe`, a bf16
Qwen3MoeForCausalLM safetensors checkpoint) with the converter vendored in the llama-cpp-python
sdist that `bench/setup_llamacpp.sh` unpacks (`vendor/llama.cpp/convert_hf_to_gguf.py`, which
puts its own `gguf-py` first on sys.path), then quantizes with that build's own
`llama_model_quantize` (the function behind `llama-quantize`, through the package's ctypes
bindings):

  - `f32`, `bf16`: `convert_hf_to_gguf.py --outtype f32|bf16` (norms and the router stay f32,
    as the converter always does);
  - `q8_0`, `q4_0`: `llama_model_quantize(model-f32.gguf, ..., LLAMA_FTYPE_MOSTLY_Q8_0|Q4_0)`
    with the default parameters, i.e. llama-quantize's default mix for that type (for Q4_0 the
    output matrix becomes Q6_K); the tensor types each file ends up with are in manifest.json;
  - `mxfp4_moe`: `llama_model_quantize(..., LLAMA_FTYPE_MOSTLY_MXFP4_MOE)`, llama-quantize's
    gpt-oss recipe: experts MXFP4 (an MXFP4 checkpoint's are copied as they are), every other
    matrix Q8_0 (the LM head too).
The file quantized from is `quant_base` (default `f32`; `bf16` holds the same values for a
bf16 checkpoint in half the bytes, what bench/real_scale.py uses at real size). gpt-oss's MXFP4
experts (`*_blocks` / `*_scales`) go into every converted GGUF as MXFP4, untouched (the
converter's own repacking), so only `bf16`/`f32` and `mxfp4_moe` apply to such a checkpoint
(Q8_0/Q4_0 would have to requantize them, which llama_model_quantize refuses).

The checkpoint has no tokenizer (the benchmark feeds token ids) and the converter insists on
one, so the checkpoint's files are linked into a copy folder beside a THROWAWAY byte-level BPE
tokenizer with `vocab_size` entries (8192 here; at most 65792): 256 byte symbols and 2-symbol
merges; the converter pads a larger vocabulary (gpt-oss's 201088, Qwen3's 151936) with unused
`[PAD<id>]` tokens up to config.json's `vocab_size`. Only the size matters (it fixes the GGUF's
token list, hence the embedding / logits width that llama.cpp checks token ids against); no text
is ever tokenized, so its contents do not matter. For the same reason the converter's
pre-tokenizer detection (a hash of how the tokenizer splits a test string, which only real
published tokenizers pass) is answered with the shipped model's: `"gpt-4o"` for gpt-oss,
Qwen's `"qwen2"` otherwise (PRE_TOKENIZERS).

Files are cached under `ROOT/gguf/<checkpoint name>-<first 12 hex of the sha256 of its
config.json and safetensors>/` (ROOT default bench/.venvs/llamacpp; a caller may name the folder
instead, as bench/real_scale.py does for checkpoints already named by a hash), each written to
a temporary name and renamed, so a rerun or a concurrent run never sees half a file.

    python bench/llamacpp_gguf.py --model ~/.cache/moe-engine/bench-qwen3-moe   # prints JSON

Run by a python with torch, transformers, tokenizers, numpy, pyyaml (the project's); the
quantize step re-runs this file under the llama.cpp venv's python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import runpy
import subprocess
import sys
from collections import Counter
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_ROOT = BENCH_DIR / ".venvs" / "llamacpp"
SDIST = "llama_cpp_python-0.3.36"
#: GGUF type -> how it is made: ("convert", converter --outtype) or ("quantize", LLAMA_FTYPE_*).
GGUF_TYPES = {
    "f32": ("convert", "f32"),
    "bf16": ("convert", "bf16"),
    "q8_0": ("quantize", "LLAMA_FTYPE_MOSTLY_Q8_0"),
    "q4_0": ("quantize", "LLAMA_FTYPE_MOSTLY_Q4_0"),
    "mxfp4_moe": ("quantize", "LLAMA_FTYPE_MOSTLY_MXFP4_MOE"),
}
#: What a caller gets without naming types (mxfp4_moe only on request: bench/real_scale.py).
DEFAULT_TYPES = ("f32", "bf16", "q8_0", "q4_0")
#: config.json model_type -> the pre-tokenizer the shipped model's tokenizer hashes to.
PRE_TOKENIZERS = {"gpt_oss": "gpt-4o"}
DEFAULT_PRE_TOKENIZER = "qwen2"
#: The largest throwaway tokenizer (256 bytes + every 2-byte merge).
MAX_THROWAWAY_VOCAB = 256 + 256 * 256


def llama_cpp_src(root: Path) -> Path:
    """The vendored llama.cpp source folder of the unpacked sdist under `root`."""
    return root / "src" / SDIST / "vendor" / "llama.cpp"


def checkpoint_key(ckpt: Path) -> str:
    """`<name>-<12 hex>`: sha256 over config.json and every *.safetensors file, in name order."""
    digest = hashlib.sha256()
    for path in [ckpt / "config.json", *sorted(ckpt.glob("*.safetensors"))]:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return f"{ckpt.name}-{digest.hexdigest()[:12]}"


def write_throwaway_tokenizer(dest: Path, vocab_size: int) -> None:
    """A byte-level BPE `tokenizer.json` + `tokenizer_config.json` in `dest` with
    min(`vocab_size`, MAX_THROWAWAY_VOCAB) ids: the 256 byte symbols of GPT-2's byte-to-unicode
    map, then merges of two symbols in a fixed order. Its contents are arbitrary (see the module
    docstring); the converter pads the rest of a larger vocabulary.

    Raises:
        ValueError: vocab_size below 257.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size <= 256:
        raise ValueError(f"vocab_size must be at least 257, got {vocab_size}")
    vocab_size = min(vocab_size, MAX_THROWAWAY_VOCAB)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) == vocab_size:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}))


def make_copy_dir(ckpt: Path, dest: Path) -> Path:
    """`dest` holding links to the checkpoint's files and the throwaway tokenizer."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in ckpt.iterdir():
        link = dest / path.name
        if path.is_file() and not link.exists():
            link.symlink_to(path.resolve())
    vocab_size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    write_throwaway_tokenizer(dest, vocab_size)
    return dest


def _convert_in_process(src: Path, argv: list[str]) -> None:
    """Run the vendored convert_hf_to_gguf.py with `argv` (its first item the model folder),
    its pre-tokenizer check answered with PRE_TOKENIZERS' entry for the model."""
    sys.path[:0] = [str(src / "gguf-py"), str(src)]
    import conversion.base as base

    model_type = json.loads((Path(argv[0]) / "config.json").read_text()).get("model_type")
    pre = PRE_TOKENIZERS.get(model_type, DEFAULT_PRE_TOKENIZER)
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


def _quantize_in_process(src_gguf: Path, dst_gguf: Path, ftype: str) -> None:
    """`llama_model_quantize` with default parameters (needs the llama.cpp venv's python).

    Raises:
        RuntimeError: a non-zero return code.
    """
    import ctypes

    import llama_cpp.llama_cpp as ll

    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, ftype)
    params.nthread = os.cpu_count() or 1
    rc = ll.llama_model_quantize(str(src_gguf).encode(), str(dst_gguf).encode(),
                                 ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src_gguf}, {ftype}) returned {rc}")


def describe(path: Path, src: Path) -> dict:
    """Size in bytes and the count of tensors per ggml type of one GGUF (vendored gguf-py)."""
    sys.path.insert(0, str(src / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {"bytes": path.stat().st_size, "tensor_types": dict(sorted(types.items()))}


def ensure_ggufs(ckpt: Path, root: Path = DEFAULT_ROOT, types: list[str] | None = None,
                 quant_base: str = "f32", out: Path | None = None) -> dict[str, Path]:
    """Make (or find) the GGUFs of `ckpt` under `out` (default `root/gguf/<checkpoint_key>/`);
    returns type -> path. Quantized types are made from the `quant_base` GGUF (made first).

    Raises:
        FileNotFoundError: the sdist is not unpacked or the venv missing (run
            bench/setup_llamacpp.sh).
        subprocess.CalledProcessError: the converter or the quantizer failed.
    """
    src = llama_cpp_src(root)
    venv_python = root / "venv" / "bin" / "python"
    for need in (src / "convert_hf_to_gguf.py", venv_python):
        if not need.exists():
            raise FileNotFoundError(f"{need} missing: run bench/setup_llamacpp.sh")
    out = out or root / "gguf" / checkpoint_key(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in types or list(DEFAULT_TYPES):
        how, arg = GGUF_TYPES[kind]
        final = out / f"model-{kind}.gguf"
        paths[kind] = final
        if final.is_file():
            continue
        tmp = out / f".model-{kind}.gguf.tmp-{os.getpid()}"
        if how == "convert":
            copy = make_copy_dir(ckpt, out / "hf-with-throwaway-tokenizer")
            cmd = [sys.executable, __file__, "_convert", str(src), "--",
                   str(copy), "--outtype", arg, "--outfile", str(tmp)]
            env = dict(os.environ)
        else:
            base = ensure_ggufs(ckpt, root, [quant_base], quant_base, out)[quant_base]
            cmd = [str(venv_python), __file__, "_quantize", str(base), str(tmp), arg]
            env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(root / "build" / "bin")}
        print(f"[llamacpp_gguf] {' '.join(cmd)}", file=sys.stderr)
        try:
            subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    manifest = out / "manifest.json"
    info = json.loads(manifest.read_text()) if manifest.is_file() else {}
    for kind, path in paths.items():
        if kind not in info:
            info[kind] = {"file": path.name, **describe(path, src)}
    manifest.write_text(json.dumps(info, indent=1, sort_keys=True))
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_convert"]:  # internal: python llamacpp_gguf.py _convert SRC -- ARGS
        _convert_in_process(Path(argv[1]), argv[3:])
        return 0
    if argv[:1] == ["_quantize"]:  # internal: venv python llamacpp_gguf.py _quantize IN OUT FT
        _quantize_in_process(Path(argv[1]), Path(argv[2]), argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--root", type=Path, default=Path(os.environ.get("LLAMACPP_DIR",
                                                                     DEFAULT_ROOT)),
                   help="setup_llamacpp.sh's folder (default $LLAMACPP_DIR or "
                        "bench/.venvs/llamacpp)")
    p.add_argument("--types", default=",".join(DEFAULT_TYPES),
                   help=f"comma-separated subset of {','.join(GGUF_TYPES)}")
    p.add_argument("--quant-base", choices=["f32", "bf16"], default="f32",
                   help="the GGUF the quantized types are made from (default f32)")
    args = p.parse_args(argv)
    types = args.types.split(",")
    unknown = sorted(set(types) - set(GGUF_TYPES))
    if unknown:
        p.error(f"unknown GGUF types {unknown}")
    paths = ensure_ggufs(args.model, args.root, types, args.quant_base)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
