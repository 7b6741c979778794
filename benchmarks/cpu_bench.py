"""The CPU against its own limits: matmul peaks and memory bandwidth beside decode and update rates.

    python -m benchmarks.cpu_bench [--sections matmul,bandwidth,decode,update] [--requests 1,16,64]
                                   [--new-tokens 64] [--engines hf,vllm,llama.cpp] [--json PATH]

Everything on SmolLM2-135M's shapes, with torch's threads (one per core), in one run, so each rate
is given as a fraction of a peak measured minutes before on the same machine:

- ``matmul``: GFLOP/s of ``x @ W`` with ``W`` 576 × 1536 (the MLP's up projection) at 1 to 1,024
  rows of ``x``, float32 and bfloat16 (bfloat16 runs on the CPU's matrix units where it has
  them: AMX or AVX512-BF16), the best of ``--repeats`` timings;
- ``bandwidth``: GB/s of reading a 512 MB tensor (a sum), the bound of a one-row decode step,
  which reads every weight once: 540 MB in float32, 270 MB in bfloat16;
- ``gemv``: one row through each linear layer of a decode step (a product that streams its weight
  once), eager ``F.linear`` beside ``torch.compile(mode="max-autotune")`` with frozen weights
  (inductor's C++ GEMM kernels instead of the BLAS call), in GB/s of weights read;
- ``decode``: HFEngine's tokens/s at each of ``--requests`` concurrent requests (the prompts of
  ``benchmarks.engine_bench``, exactly ``--new-tokens`` each (``ignore_eos``; runs before issue 47's
  third part stopped at end-of-sequence: one request then sampled 8 tokens), temperature 1, seeded), with its forward
  passes in float32 and from a bfloat16 copy of the weights (its decode steps fused, ``hf``, and through
  transformers' modules, ``hf-tf``, and on a CPU with AMX the fused step with its attention as two
  batched products instead of torch's flash kernel, ``hf-products``, alternated twice on one engine,
  the better of each: :class:`~agents.engines.fused_decode.FusedDecodeStep`,
  :data:`~agents.engines.cpu_kernels.FLASH_DECODE`); model GFLOP/s (2 × 134.5 M FLOPs a
  token) and their fraction of the matmul peak at that many rows; the largest difference of a
  sampled log-prob to a float32 forward pass over the same tokens (``--engines hf``, the default);
  the same for the inference a CPU user would otherwise pick: vLLM's CPU engine (``vllm``, the
  model in float32 and in bfloat16) and llama.cpp (``llama.cpp``, llama-cpp-python, which builds
  it from source: the shipped Q4_1 GGUF and its F16 and BF16 conversions, the requests as
  parallel sequences of one context);
- ``update``: forward and backward with the full-vocabulary loss over 8 × 512 tokens, float32 and
  under bfloat16 autocast (6 × 134.5 M FLOPs a token), against the 1,024-row matmul peak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from typing import Any

import numpy as np
import torch

from agents.models import DEFAULT_MODEL, load_model, load_tokenizer
from benchmarks.engine_bench import concurrent_rate, requests

SECTIONS = ("matmul", "bandwidth", "gemv", "decode", "update")
#: The linear layers of a SmolLM2-135M decode step, (out, in): q and o, k and v, gate and up, down, the output layer.
LINEARS = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}
HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M
PARAMETERS = 134_515_008  # its weights, the tied embedding counted once (it is the output layer's too)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def cpu_features() -> dict[str, Any]:
    """What the CPU is and which of its bfloat16 units torch sees."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "amx": torch.cpu._is_amx_tile_supported(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "torch": torch.__version__,
    }


def best_seconds(run, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``run()`` after one warm-up (these machines are shared)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peaks(rows: list[int], repeats: int) -> list[dict[str, Any]]:
    out = []
    for dtype_name, dtype in DTYPES.items():
        weight = torch.randn(HIDDEN, INTERMEDIATE).to(dtype)
        for n in rows:
            x = torch.randn(n, HIDDEN).to(dtype)
            inner = max(1, 4096 // n)  # enough work per timing to see past the clock
            seconds = best_seconds(lambda x=x, w=weight, k=inner: [x @ w for _ in range(k)], repeats) / inner
            out.append(dict(dtype=dtype_name, rows=n, gflops=2 * n * HIDDEN * INTERMEDIATE / seconds / 1e9))
    return out


def bandwidth(repeats: int) -> float:
    """GB/s of reading 512 MB once."""
    data = torch.ones(128 * 2**20)  # 512 MB of float32
    return data.numel() * 4 / best_seconds(data.sum, repeats) / 1e9


class Fanout(torch.nn.Module):
    """``count`` distinct linear layers of one shape, each applied to the same input (one graph to compile)."""

    def __init__(self, rows_in: int, rows_out: int, count: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(rows_in, rows_out, bias=False).to(dtype) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(layer(x) for layer in self.layers)


def gemv_rates(repeats: int) -> list[dict[str, Any]]:
    """One row through each of the step's linear layers: eager ``F.linear`` beside inductor's own GEMM kernels.

    At one row a product streams its weight once, so its rate is given in GB/s of weights read.
    The alternative is ``torch.compile(mode="max-autotune")`` with frozen weights, which lets
    inductor's C++ GEMM template replace the BLAS call (its compile time is reported too).
    """
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights are constants: packed once
    out = []
    for dtype_name, dtype in DTYPES.items():
        for name, (rows_out, rows_in) in LINEARS.items():
            # Distinct layers, as a step's 30 are, over more memory than the caches hold: each weight comes from memory.
            count = min(64, max(1, 2**27 // (rows_out * rows_in * DTYPE_BYTES[dtype_name])))
            layers = Fanout(rows_in, rows_out, count, dtype)
            x = torch.randn(1, rows_in).to(dtype)
            with torch.no_grad():
                eager = best_seconds(lambda layers=layers, x=x: layers(x), repeats) / count
                torch._dynamo.reset()  # a fresh compile for each shape, never a fallback past the recompile limit
                start = time.perf_counter()
                compiled = torch.compile(layers, mode="max-autotune", dynamic=False)
                compiled(x)
                compile_s = time.perf_counter() - start
                fast = best_seconds(lambda compiled=compiled, x=x: compiled(x), repeats) / count
            megabytes = rows_out * rows_in * x.element_size() / 1e6
            out.append(
                dict(
                    dtype=dtype_name,
                    layer=name,
                    eager_us=eager * 1e6,
                    eager_gbs=megabytes / eager / 1e3,
                    inductor_us=fast * 1e6,
                    inductor_gbs=megabytes / fast / 1e3,
                    compile_s=compile_s,
                )
            )
            print(f"  gemv {dtype_name} {name}: eager {eager * 1e6:.0f} us, inductor {fast * 1e6:.0f} us", flush=True)
    return out


def peak(matmul: list[dict[str, Any]], dtype: str, rows: int) -> float | None:
    """The measured matmul GFLOP/s of ``dtype`` at the measured row count nearest ``rows``."""
    candidates = [r for r in matmul if r["dtype"] == dtype]
    if not candidates:
        return None
    return min(candidates, key=lambda r: abs(r["rows"] - rows))["gflops"]


async def decode_rates(
    engine_name: str, concurrency: list[int], new_tokens: int, reference_model, tokenizer
) -> list[dict[str, Any]]:
    """``hf``: HFEngine generating from the float32 model and from its bfloat16 copy; ``vllm``: vLLM's CPU engine
    with the model in float32 and in bfloat16."""
    from agents.engines import Engine, cpu_kernels, make_engine
    from agents.engines.hf import HFEngine

    rows = []
    for dtype_name, dtype in DTYPES.items():
        engine: Engine
        if engine_name == "hf":
            engine = HFEngine(
                model=load_model(DEFAULT_MODEL),
                tokenizer=tokenizer,
                compute_dtype=dtype,
                max_batch_size=max(concurrency),
            )
        else:
            engine = make_engine(
                "vllm",
                DEFAULT_MODEL,
                concurrency=max(concurrency),
                max_model_len=2048,
                engine_kwargs={"dtype": dtype_name},
            )
        # The fused decode step, transformers' forward pass ("hf-tf") and, where the step's attention is torch's
        # flash kernel (AMX), the step with the two batched products instead ("hf-products"), alternated on one
        # engine: the ratio of two engines run minutes apart carries the machine's drift (2 cores, shared).
        fused = getattr(engine, "fused_decode", None)
        flash = cpu_kernels.FLASH_DECODE
        variants = {engine_name: (fused, flash)}
        if fused is not None:
            variants["hf-tf"] = (None, flash)
            if flash and dtype == torch.bfloat16:
                variants["hf-products"] = (fused, False)
        try:
            await engine.generate(*requests(tokenizer, 1, 4)[0])  # warm-up
            for n in concurrency:
                best: dict[str, dict[str, Any]] = {}
                for label in [*variants] * (2 if len(variants) > 1 else 1):
                    if fused is not None:
                        engine.fused_decode, cpu_kernels.FLASH_DECODE = variants[label]  # type: ignore[attr-defined]
                    row = await concurrent_rate(engine, tokenizer, n, new_tokens, reference_model, ignore_eos=True)
                    if label not in best or row["tokens_per_s"] > best[label]["tokens_per_s"]:
                        best[label] = row
                for label, row in best.items():
                    gflops = 2 * PARAMETERS * row["tokens_per_s"] / 1e9
                    rows.append(dict(engine=label, dtype=dtype_name, **row, gflops=gflops))
                    print(
                        f"  decode {label} {dtype_name} {n:>3} requests: {row['tokens_per_s']:7.1f} tok/s", flush=True
                    )
        finally:
            cpu_kernels.FLASH_DECODE = flash
            await engine.close()
    return rows


LLAMA_FORMATS = {"Q4_1": None, "F16": 1, "BF16": 32}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* of each conversion


def llamacpp_rates(concurrency: list[int], new_tokens: int, tokenizer, folder: str) -> list[dict[str, Any]]:
    """llama.cpp (llama-cpp-python's bindings of its C API) on the shipped Q4_1 GGUF and on its F16 and BF16
    conversions by llama.cpp's own quantizer (the Q4_1 weights widened: what the float32 checkpoint holds too).

    ``n`` requests decode as ``n`` sequences of one context (a KV stream each: one shared buffer,
    ``kv_unified``, ran 64 requests at 133 tok/s against 316 in BF16), one ``llama_decode`` of ``n`` tokens a
    step (its parallel-sequence batching, as its server's slots do); the prompts prefill in one batch. Each step samples
    at temperature 1 from the step's logits in one Gumbel-max draw (torch), exactly ``new_tokens`` a sequence.
    """
    import ctypes

    import llama_cpp as llama  # type: ignore[import-not-found]  # optional: `pip install llama-cpp-python`

    from agents.models import embedded_gguf_file

    llama.llama_backend_init()
    shipped = embedded_gguf_file(DEFAULT_MODEL)
    threads = os.cpu_count() or 1
    rows = []
    for name, ftype in LLAMA_FORMATS.items():
        path = str(shipped)
        if ftype is not None:
            path = os.path.join(folder, f"{shipped.stem.rsplit('.', 1)[0]}.{name}.gguf")
            if not os.path.exists(path):
                params = llama.llama_model_quantize_default_params()
                params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
                if llama.llama_model_quantize(str(shipped).encode(), path.encode(), ctypes.byref(params)) != 0:
                    raise RuntimeError(f"llama.cpp could not convert {shipped} to {name}")
        model = llama.llama_model_load_from_file(path.encode(), llama.llama_model_default_params())
        vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
        try:
            for n in concurrency:
                prompts = [prompt for prompt, _ in requests(tokenizer, n, new_tokens)]
                seconds = _llamacpp_decode(llama, model, vocab, prompts, new_tokens, threads)
                row = rate_row(n * new_tokens, seconds, 2 * PARAMETERS)
                rows.append(dict(engine="llama.cpp", dtype=name, requests=n, **row))
                print(f"  decode llama.cpp {name} {n:>3} requests: {row['tokens_per_s']:7.1f} tok/s", flush=True)
        finally:
            llama.llama_model_free(model)
    return rows


def _llamacpp_decode(llama, model, vocab: int, prompts: list[list[int]], new_tokens: int, threads: int) -> float:
    """Seconds for ``prompts`` to prefill and decode ``new_tokens`` each as sequences of one llama.cpp context."""
    n, prompt_tokens = len(prompts), sum(len(p) for p in prompts)
    params = llama.llama_context_default_params()
    params.n_ctx = n * (max(len(p) for p in prompts) + new_tokens + 8)
    params.n_batch = max(prompt_tokens, n)
    params.n_seq_max, params.kv_unified = n, False  # a KV stream a sequence (n_ctx / n each): attention reads its own
    params.n_threads = params.n_threads_batch = threads
    context = llama.llama_init_from_model(model, params)
    batch = llama.llama_batch_init(params.n_batch, 0, 1)
    generator = torch.Generator().manual_seed(0)

    def run(entries: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """Decode (token, position, sequence, wants logits) entries; the logits asked for, in order."""
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
            batch.seq_id[i][0] = sequence
        batch.n_tokens = len(entries)
        if llama.llama_decode(context, batch) != 0:
            raise RuntimeError("llama_decode failed")
        wanted = sum(entry[3] for entry in entries)
        return torch.from_numpy(np.ctypeslib.as_array(llama.llama_get_logits(context), shape=(wanted, vocab)))

    try:
        start = time.perf_counter()
        logits = run(
            [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        )
        for step in range(new_tokens):
            gumbel = -torch.empty_like(logits).exponential_(generator=generator).log()
            tokens = (logits + gumbel).argmax(-1).tolist()  # a temperature-1 sample a row
            if step < new_tokens - 1:
                logits = run([(t, len(prompts[s]) + step, s, True) for s, t in enumerate(tokens)])
        return time.perf_counter() - start
    finally:
        llama.llama_batch_free(batch)
        llama.llama_free(context)


def update_rates(repeats: int) -> list[dict[str, Any]]:
    from agents.training.scoring import score_tokens

    model = load_model(DEFAULT_MODEL).train()
    ids = torch.randint(0, model.config.vocab_size, (8, 512), generator=torch.Generator().manual_seed(0))
    rows = []
    for dtype_name, dtype in DTYPES.items():

        def step(dtype=dtype) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                logprobs = score_tokens(model(ids).logits, ids)[0]
            (-logprobs.mean()).backward()
            model.zero_grad(set_to_none=True)

        row = rate_row(ids.numel(), best_seconds(step, repeats), 6 * PARAMETERS)
        rows.append(dict(dtype=dtype_name, **row))
        print(f"  update {dtype_name}: {row['tokens_per_s']:7.1f} tok/s", flush=True)
    return rows


def rate_row(tokens: int, seconds: float, flops_a_token: float) -> dict[str, float]:
    """Tokens in seconds as a table row: the counts, tokens/s and model GFLOP/s."""
    return dict(
        tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, gflops=flops_a_token * tokens / seconds / 1e9
    )


def percent(value: float, of: float | None) -> str:
    return f"{100 * value / of:5.1f}%" if of else "    -"


def print_tables(result: dict[str, Any]) -> None:
    matmul = result.get("matmul", [])
    print(
        f"cpu: {result['cpu']['cpu']}, {result['cpu']['torch_threads']} threads, "
        f"AMX {result['cpu']['amx']}, AVX512-BF16 {result['cpu']['avx512_bf16']}, torch {result['cpu']['torch']}"
    )
    if matmul:
        print(f"\nmatmul x[rows, {HIDDEN}] @ W[{HIDDEN}, {INTERMEDIATE}], GFLOP/s (best of the repeats)")
        print(f"{'rows':>6} {'float32':>9} {'bfloat16':>9} {'bf16/f32':>9}")
        for n in sorted({r["rows"] for r in matmul}):
            f32, bf16 = peak(matmul, "float32", n), peak(matmul, "bfloat16", n)
            assert f32 is not None and bf16 is not None
            print(f"{n:>6} {f32:>9.1f} {bf16:>9.1f} {bf16 / f32:>9.2f}")
    if "bandwidth_gbs" in result:
        gbs = result["bandwidth_gbs"]
        print(
            f"\nmemory read: {gbs:.1f} GB/s; a one-row decode step reads every weight once: at most "
            f"{gbs * 1e9 / (4 * PARAMETERS):.0f} tok/s in float32, {gbs * 1e9 / (2 * PARAMETERS):.0f} in bfloat16"
        )
    if result.get("gemv"):
        print("\none row through each linear layer of a decode step: GB/s of weights read (eager F.linear, inductor)")
        print(
            f"{'dtype':<9} {'layer':<8} {'eager us':>9} {'GB/s':>6} {'inductor us':>12} {'GB/s':>6} {'ratio':>6} {'compile s':>10}"
        )
        for r in result["gemv"]:
            print(
                f"{r['dtype']:<9} {r['layer']:<8} {r['eager_us']:>9.1f} {r['eager_gbs']:>6.1f} {r['inductor_us']:>12.1f} "
                f"{r['inductor_gbs']:>6.1f} {r['eager_us'] / r['inductor_us']:>6.2f} {r['compile_s']:>10.1f}"
            )
    if result.get("decode"):
        print("\ndecode (tokens/s; GFLOP/s at 2N a token; % of the matmul peak at as many rows)")
        header = f"{'engine':<9} {'dtype':<9} {'requests':>8} {'tok/s':>8} {'GFLOP/s':>8} {'% peak':>7}"
        print(f"{header} {'max |Δ logprob|':>16}")
        for r in result["decode"]:
            mismatch = f"{r['max_abs_logprob_diff']:>16.2e}" if "max_abs_logprob_diff" in r else f"{'-':>16}"
            print(
                f"{r.get('engine', 'hf'):<9} {r['dtype']:<9} {r['requests']:>8} {r['tokens_per_s']:>8.1f} "
                f"{r['gflops']:>8.1f} {percent(r['gflops'], peak(matmul, r['dtype'], r['requests'])):>7} {mismatch}"
            )
        by = {(r.get("engine", "hf"), r["dtype"], r["requests"]): r["tokens_per_s"] for r in result["decode"]}
        pairs = [(("hf", "bfloat16"), ("hf", "float32")), (("hf", "bfloat16"), ("hf-tf", "bfloat16"))]
        pairs += [(("hf", "bfloat16"), ("hf-products", "bfloat16"))]
        pairs += [(("hf", dtype), ("vllm", dtype)) for dtype in DTYPES] + [(("hf", "bfloat16"), ("llama.cpp", "BF16"))]
        for n in sorted({r["requests"] for r in result["decode"]}):
            for a, b in pairs:
                if (*a, n) in by and (*b, n) in by:
                    print(f"  {' '.join(a)} / {' '.join(b)} at {n} requests: {by[(*a, n)] / by[(*b, n)]:.2f}x")
    if result.get("update"):
        print("\nforward + backward, 8 x 512 tokens, full-vocabulary loss (GFLOP/s at 6N a token)")
        print(f"{'dtype':<9} {'tok/s':>8} {'GFLOP/s':>8} {'% peak':>7}")
        for r in result["update"]:
            print(
                f"{r['dtype']:<9} {r['tokens_per_s']:>8.1f} {r['gflops']:>8.1f} "
                f"{percent(r['gflops'], peak(matmul, r['dtype'], 1024)):>7}"
            )
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--rows", default="1,16,64,1024", help="matmul row counts")
    parser.add_argument("--requests", default="1,16,64", help="decode: concurrent requests")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode: new tokens a request")
    parser.add_argument(
        "--engines",
        default="hf",
        help="decode: hf (HFEngine), vllm (vLLM's CPU engine), llama.cpp (`pip install llama-cpp-python`)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timings of each matmul, bandwidth and update")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if not set(args.engines.split(",")) <= {"hf", "vllm", "llama.cpp"}:
        parser.error(f"--engines takes hf, vllm and/or llama.cpp, got {args.engines!r}")
    result: dict[str, Any] = {"cpu": cpu_features(), "args": vars(args)}
    if "matmul" in sections:
        result["matmul"] = matmul_peaks([int(n) for n in args.rows.split(",")], args.repeats)
    if "bandwidth" in sections:
        result["bandwidth_gbs"] = bandwidth(args.repeats)
    if "gemv" in sections:
        result["gemv"] = gemv_rates(args.repeats)
    if "decode" in sections:
        tokenizer = load_tokenizer(DEFAULT_MODEL)
        reference = load_model(DEFAULT_MODEL)
        concurrency = [int(n) for n in args.requests.split(",")]
        result["decode"] = []
        for engine_name in args.engines.split(","):
            if engine_name == "llama.cpp":
                with tempfile.TemporaryDirectory() as folder:  # its F16 and BF16 conversions
                    result["decode"] += llamacpp_rates(concurrency, args.new_tokens, tokenizer, folder)
            else:
                result["decode"] += asyncio.run(
                    decode_rates(engine_name, concurrency, args.new_tokens, reference, tokenizer)
                )
    if "update" in sections:
        result["update"] = update_rates(max(2, args.repeats // 2))
    result["load_average_1min"] = os.getloadavg()[0]
    print_tables(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
