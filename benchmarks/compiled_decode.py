"""How fast a decode step could run here: HFEngine's fused step beside the same step compiled whole by inductor with
its weights frozen.

HFEngine's bfloat16 decode step (:class:`~agents.engines.fused_decode.FusedDecodeStep`) multiplies by weights packed
for oneDNN, which streams them at ~10 GB/s at one row on a 2-core Xeon with AMX, about half of what the machine
reads. ``torch.compile(mode="max-autotune")`` with ``torch._inductor.config.freezing`` replaces those products with
inductor's own AMX micro-kernels on weights it packs at compile time, and fuses the step's small operations. It
needs the weights to be constants: a trainer changes them every step, so HFEngine cannot use it as it is, and the
compile takes minutes. This benchmark measures what it would buy, so the bound is a measured one: the same
arithmetic as the fused step (its query, key and value products as one, its gate and up products as one, torch's
flash kernel for attention), on the same KV rooms, with the logits' largest difference to the fused step's.

    python -m benchmarks.compiled_decode --rows 1,64 --json benchmarks/results/compiled_decode.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F

from agents.engines.cpu_kernels import pack_linear_layers
from agents.engines.fused_decode import (
    FusedDecodeStep,
    _attention_projections,
    _fused_bias,
    _mlp_projections,
    _rotate,
)
from agents.engines.kv_cache import SlotCache
from agents.models import DEFAULT_MODEL, load_model
from benchmarks.cpu_bench import bandwidth, cpu_features


class FrozenDecodeStep(torch.nn.Module):
    """The fused step's arithmetic with its fused weights as parameters, in a form inductor can freeze.

    ``forward(token_ids, mask, lengths, keys, values)``: each row's newest token, the boolean mask
    [rows, 1, 1, width] of :meth:`SlotCache.decode_inputs`, the rows' lengths, and the cache's rooms per layer
    (written at each row's length, as the fused step writes them); float32 logits [rows, vocab].
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        layers = model.model.layers

        def fused(*linears: torch.nn.Linear) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]), requires_grad=False)

        self.qkv = torch.nn.ParameterList(fused(*_attention_projections(layer)) for layer in layers)
        self.gate_up = torch.nn.ParameterList(fused(*_mlp_projections(layer)) for layer in layers)
        # None for SmolLM2's and Llama's; Qwen2's q, k and v have biases.
        self.qkv_bias = [_fused_bias(_attention_projections(layer)) for layer in layers]
        self.gate_up_bias = [_fused_bias(_mlp_projections(layer)) for layer in layers]

    def forward(
        self,
        token_ids: torch.Tensor,
        mask: torch.Tensor,
        lengths: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        model = self.model.model
        rows, width = token_ids.shape[0], mask.shape[-1]
        rows_index = torch.arange(rows)
        hidden = model.embed_tokens(token_ids)
        cos, sin = model.rotary_emb(hidden, lengths[:, None])
        for i, layer in enumerate(model.layers):
            attention = layer.self_attn
            dim = attention.head_dim
            heads, kv_heads = attention.q_proj.out_features // dim, attention.k_proj.out_features // dim
            projected = F.linear(layer.input_layernorm(hidden), self.qkv[i], self.qkv_bias[i])
            query, key, value = projected.split((heads * dim, kv_heads * dim, kv_heads * dim), -1)
            query, key = (
                _rotate(query.view(rows, heads, dim), cos, sin),
                _rotate(key.view(rows, kv_heads, dim), cos, sin),
            )
            keys[i][rows_index, :, lengths] = key
            values[i][rows_index, :, lengths] = value.view(rows, kv_heads, dim)
            attended = F.scaled_dot_product_attention(
                query[:, :, None],
                keys[i][:rows, :, :width],
                values[i][:rows, :, :width],
                attn_mask=mask,
                scale=attention.scaling,
                enable_gqa=True,
            )
            hidden = hidden + F.linear(
                attended.reshape(rows, heads * dim), attention.o_proj.weight, attention.o_proj.bias
            )
            normed = layer.post_attention_layernorm(hidden)
            gate, up = F.linear(normed, self.gate_up[i], self.gate_up_bias[i]).chunk(2, -1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)
        head = self.model.lm_head
        return F.linear(model.norm(hidden), head.weight, head.bias).float()


def filled_cache(model: Any, rows: int, context: int) -> SlotCache:
    """A cache of ``rows`` rows, each holding the KV of the same ``context``-token prompt (a real prefill)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(min(100, vocab // 2), min(5000, vocab), (1, context), generator=generator)
    with torch.no_grad():
        prefill = model(ids, use_cache=True).past_key_values
    sequence = [(layer.keys[0], layer.values[0]) for layer in prefill.layers]
    cache = SlotCache(model.config.num_hidden_layers, rows, dtype=torch.bfloat16)
    cache.add_rows([sequence] * rows)
    return cache


#: The compiled variants: inductor's settings for each. ``inputs``: the weights are the graph's inputs (a trainer's
#: in-place updates are seen; the products stay oneDNN's); ``frozen``: constants, packed for inductor's AMX kernels.
VARIANTS: dict[str, tuple[bool, str]] = {"inputs": (False, "default"), "frozen": (True, "max-autotune")}


def measure(
    rows: int, context: int, steps: int, engine_model: Any, frozen_model: Any, variants: list[str]
) -> dict[str, Any]:
    """The fused step and each compiled variant, ``steps`` decode steps from ``context`` positions, alternated twice."""
    import torch._inductor.config as inductor_config

    tokens = torch.randint(100, 5000, (rows,), generator=torch.Generator().manual_seed(1))
    fused = FusedDecodeStep(engine_model)

    def run(step, cache: SlotCache) -> torch.Tensor:
        mask, _ = cache.decode_inputs()
        if step is fused:
            logits = fused(tokens, mask, cache)
        else:
            rooms = [layer.kv() for layer in cache.slot_layers]
            mask = mask.bool()[:, None, None, :]
            logits = step(tokens, mask, cache.lengths, [k for k, _ in rooms], [v for _, v in rooms])
        cache.advance()
        return logits

    out: dict[str, Any] = dict(rows=rows, context=context)
    seconds = {"fused": float("inf")}

    def time_steps(name: str, step) -> None:
        cache = filled_cache(engine_model, rows, context)
        run(step, cache)  # warm
        begin = time.perf_counter()
        for _ in range(steps):
            run(step, cache)
        seconds[name] = min(seconds.get(name, float("inf")), (time.perf_counter() - begin) / steps)

    with torch.no_grad():
        for name in variants:
            freezing, mode = VARIANTS[name]
            # A compile of its own, timed and measured before the next: a reset drops every compiled function's code.
            torch._dynamo.reset()
            inductor_config.freezing = freezing
            compiled = torch.compile(FrozenDecodeStep(frozen_model), mode=mode, dynamic=True)
            start = time.perf_counter()
            run(compiled, filled_cache(engine_model, rows, context))
            out[f"{name}_compile_s"] = time.perf_counter() - start
            # the same state in both caches: one step of each from the same rooms, compared
            reference, candidate = filled_cache(engine_model, rows, context), filled_cache(engine_model, rows, context)
            out[f"{name}_max_abs_logit_diff"] = (run(fused, reference) - run(compiled, candidate)).abs().max().item()
            for _ in range(2):  # alternated with the fused step: the machine drifts
                time_steps("fused", fused)
                time_steps(name, compiled)
    for name, step_s in seconds.items():
        out[f"{name}_ms"] = step_s * 1e3
        out[f"{name}_tokens_per_s"] = rows / step_s
        out[f"{name}_speedup"] = seconds["fused"] / step_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,64", help="comma-separated decode rows")
    parser.add_argument("--context", type=int, default=60, help="positions each row holds before the steps")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"compiled variants: {', '.join(VARIANTS)}")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    variants = args.variants.split(",")
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True  # bfloat16 rounding where eager rounds, not float32 throughout
    engine_model = load_model(DEFAULT_MODEL, torch.bfloat16).eval()
    pack_linear_layers(engine_model)  # as HFEngine's compute copy
    frozen_model = load_model(DEFAULT_MODEL, torch.bfloat16).eval()
    gbs = bandwidth(3)
    weight_bytes = sum(p.numel() * p.element_size() for p in frozen_model.parameters())
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        print(f"rows {rows}: compiling {len(variants)} variants (minutes) ...", flush=True)
        results.append(measure(rows, args.context, args.steps, engine_model, frozen_model, variants))
    bound = gbs * 1e9 / weight_bytes
    print(
        f"\nread bandwidth {gbs:.1f} GB/s; {weight_bytes / 1e6:.0f} MB of weights a step: at most {bound:.0f} steps/s"
    )
    print(f"{'rows':>5} {'step':>7} {'ms':>7} {'tok/s':>7} {'ratio':>6} {'compile s':>10} {'max |Δlogit|':>13}")
    for r in results:
        for name in ("fused", *variants):
            compile_s = f"{r[f'{name}_compile_s']:.0f}" if name in VARIANTS else "-"
            diff = f"{r[f'{name}_max_abs_logit_diff']:.3f}" if name in VARIANTS else "-"
            print(
                f"{r['rows']:>5} {name:>7} {r[f'{name}_ms']:>7.1f} {r[f'{name}_tokens_per_s']:>7.1f}"
                f" {r[f'{name}_speedup']:>5.2f}x {compile_s:>10} {diff:>13}"
            )
    if args.json:
        record = dict(
            cpu=cpu_features(),
            torch=torch.__version__,
            args=vars(args),
            bandwidth_gbs=gbs,
            weight_bytes=weight_bytes,
            results=results,
        )
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
