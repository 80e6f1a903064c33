#!/usr/bin/env python3
"""Probes which transformers decoder families `export_llm` handles, and prints a markdown table.

    .venv/bin/python scripts/probe_families.py [FAMILY ...] [--timeout 180] [--write docs/families.md]

For each family (a transformers `model_type`; default: FAMILIES below) it writes a tiny random-weight model
folder (2 layers, hidden size 64, the trained tokenizer of executorch_mlx.llm.model_folders), exports it with
max_context 64, counts the program's delegates and the ops outside them, and compares 16 greedy tokens of
LLMRunner with transformers' own greedy generation. Each family runs in a subprocess of this script
(`--one FAMILY`, printing one JSON line), so that a crash or a hang (over --timeout seconds) ends only its row.
A NotImplementedError from export is a deliberate refusal naming what is missing: "refused: <message>".
Progress (one JSON row per family) goes to stderr; the table and the total time to stdout.
`--write FILE` also writes the table, with how it was made, as a markdown page (docs/families.md); with
`--rows LOG` it writes that page from the progress lines of an earlier run (the last row of each family).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every decoder-only causal-LM type of transformers 5.23: not its encoder-decoder types (BART, Whisper, ...),
# the encoders it can run as decoders (BERT, RoBERTa, XLNet, ...), nor the multimodal ones (Gemma 3, Llama 4,
# Qwen3.5, ...) whose text models are here under their own types (gemma3_text, llama4_text, qwen3_5_text).
FAMILIES = ("llama qwen2 qwen3 gemma gemma3_text phi3 mistral olmo2 stablelm starcoder2 falcon ministral olmo olmo3 "
            "smollm3 gemma2 cohere cohere2 glm ernie4_5 hunyuan_v1_dense bitnet exaone4 helium arcee seed_oss "
            "nemotron persimmon granite phi gpt_neox gpt2 apertus qwen3_moe qwen2_moe mixtral granitemoe gpt_oss "
            "olmoe phimoe ernie4_5_moe hunyuan_v1_moe dots1 glm4_moe deepseek_v3 qwen3_next minimax llama4_text "
            "gemma3n_text lfm2 qwen3_5_text qwen3_5_moe_text lfm2_moe granitemoehybrid nemotron_h bamba mamba2 "
            "falcon_h1 zamba2 kimi_linear minimax_m2 exaone_moe flex_olmo deepseek_v32 glm4_moe_lite afmoe "
            "mimo_v2_flash longcat_flash bailing_hybrid inkling_text olmo_hybrid lfm3 mamba falcon_mamba jamba "
            "dots3_note_text gemma4_unified_text gemma4_text "
            "aria_text axk1 axk2 beam biogpt bloom codegen cohere2_moe cohere_compass_text cpmant ctrl cwm dbrx "
            "deepseek_v2 deepseek_v4 diffllama doge flint glm4 glm_moe_dsa gpt-sw3 gpt_bigcode gpt_neo "
            "gpt_neox_japanese gptj granite_swa granitemoe_swa granitemoeshared hrm_text hy_v3 hy_v4 hyperclovax "
            "inkling2_text internlm3 iquestcoder jais2 jetmoe kolibri1 laguna mellum minicpm3 minimax_m3_vl_text "
            "ministral3 modernbert-decoder mpt nanochat openai-gpt opt qwen4_exp_text recurrent_gemma rwkv "
            "solar_open vaultgemma xglm xlstm youtu zamba zaya").split()
PROMPT = "Once upon a time"
NEW_TOKENS = 16

# Set where the family's config has the field (hasattr, which follows attribute_map: gpt2's n_embd, ...).
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, head_dim=16, max_position_embeddings=2048)
EXPERTS = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32)
# Set for every family: larger random weights give distinct greedy tokens rather than ties.
ALWAYS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1, initializer_range=0.2)
# Latent attention sizes for hidden 64 (DeepSeek-V2/V3 and their kind): head_dim is the rotary part's width
# (qk_rope_head_dim), and every query head has its own key and value once the latent is expanded (key/value
# heads = heads).
LATENT = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
              num_key_value_heads=4)
# Expert groups: 4 experts cannot be split into the default 8 groups of which 4 are kept; one dense layer first.
GROUPS = dict(n_group=1, topk_group=1, first_k_dense_replace=1)
# Indexed (sparse) attention: a small indexer that keeps 8 keys per query, fewer than the probe's ~21 tokens; 8
# heads, as with 2 its ReLU'd scores often tie at 0, and transformers' growing cache breaks a tie at the k-th key
# otherwise than any static cache (transformers' own included)
INDEXER = dict(index_n_heads=8, index_head_dim=16, index_topk=8)
# Fixes a tiny model needs for a consistent config, beyond the rules of config() (per-layer lists rebuilt for 2
# layers, one layer of each of the first two layer kinds, a sliding window of 8).
OVERRIDES = {
    "glm4_moe": dict(GROUPS, n_shared_experts=1),
    "dots1": dict(GROUPS, n_shared_experts=1),  # its defaults are None
    "deepseek_v2": dict(GROUPS, **LATENT),
    "deepseek_v3": dict(GROUPS, **LATENT),
    "axk1": dict(GROUPS, **LATENT),
    "glm4_moe_lite": LATENT,
    # (their default per-layer MLP kinds start with more dense layers than the tiny model has)
    "beam": dict(GROUPS, mlp_layer_types=["dense", "sparse"]),
    "bailing_hybrid": dict(GROUPS, **LATENT, num_expert_group=1, mlp_layer_types=["dense", "sparse"]),
    # two zero-computation experts beside the 4 routed; one layer of its own (two of transformers')
    "longcat_flash": dict(LATENT, zero_expert_num=2, num_layers=1),
    "flint": dict(mlp_only_layers=[0], shared_expert_intermediate_size=32),
    "deepseek_v32": dict(GROUPS, **LATENT, **INDEXER),
    "glm_moe_dsa": dict(GROUPS, **LATENT, **INDEXER),
    "axk2": dict(GROUPS, **LATENT, **INDEXER),
    "hy_v4": dict(GROUPS, **LATENT, **INDEXER),
    "minicpm3": LATENT,
    "youtu": LATENT,
    "kimi_linear": dict(LATENT, q_lora_rank=None, linear_head_dim=16, linear_num_heads=4),
    "zamba2": dict(hybrid_layer_ids=[1]),  # its default hybrid layers start at layer 6
    # its layer kinds follow from periods: Mamba-1 then attention, experts every other layer
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "codegen": dict(rotary_dim=8),  # default 64: wider than a head
    # two hybrid layers (their shared transformer needs two to tie), after Mamba layers
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1, num_hidden_layers=4,
                  layer_types=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),  # the only count it supports
    "dots3_note_text": dict(GROUPS, **LATENT, **INDEXER),  # (key/value heads: as many as query heads)
    # a recurrent and an attention layer (its default pattern's first two are recurrent)
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64, attention_window_size=8),
    # its defaults leave the indexer unsized (transformers' own model does not build)
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32,
                           hc_lowrank=8, ple_embed_dim=16, ngram_vocab_size_base=1000, split_ngram_parts=4),
    "gptj": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),  # one layer of each kind
    # transformers' own model fails on its defaults: no rotary parameters per layer kind; a rotary theta its
    # attention reads and clipping it always applies (real DBRX configs have both)
    "cohere_compass_text": dict(rope_parameters={kind: dict(rope_type="default", rope_theta=10000.0)
                                                 for kind in ("full_attention", "sliding_attention")}),
    "dbrx": dict(d_model=64, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=32)),
    "hunyuan_v1_moe": dict(moe_topk=2),  # its own name for experts per token
    "qwen2_moe": dict(shared_expert_intermediate_size=32),  # default 5632: 20 times the rest of the model
    "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, shared_expert_intermediate_size=32),
    # no_rope_layers: one layer with RoPE, one without (1 = RoPE), as every 4th layer of the real models
    "smollm3": dict(no_rope_layers=[1, 0]),
    "llama4_text": dict(no_rope_layers=[1, 0], attention_chunk_size=8, intermediate_size_mlp=128),
    # per-layer-input embeddings as wide as the vocabulary; no KV sharing (2 layers have no earlier one to share)
    "gemma3n_text": dict(hidden_size_per_layer_input=16, num_kv_shared_layers=0, laurel_rank=8),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),  # its default: attention only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # its default: None
    # state layers and attention in one tiny model (their defaults: 1 attention layer in 6 or none in 2)
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "bamba": dict(attn_layer_indices=[1]),
    "gemma4_text": dict(num_experts=None),  # its experts are off unless enable_moe_block
    # its first two kinds are a Mamba-2 and an experts layer: one attention layer more
    "nemotron_h": dict(layer_types=["linear_attention", "full_attention", "moe"], num_hidden_layers=3),
    # Mamba-2's heads times head_dim must be expand (2) times hidden_size (64)
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16),
    # rope: original_max_position_embeddings below max_position_embeddings (2048), keeping the scaling factor
    "apertus": dict(rope_parameters=dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0,
                                         original_max_position_embeddings=256, low_freq_factor=1.0,
                                         high_freq_factor=4.0)),
    "gpt_oss": dict(rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=64)),
}


def tokenizer():
    from executorch_mlx.llm.model_folders import train_tokenizer

    return train_tokenizer()


def has(config, key: str) -> bool:
    """hasattr, also for per-layer attributes (Gemma 4's head_dim), which refuse a global read."""
    try:
        return hasattr(config, key)
    except Exception:
        return key in config.to_dict()


def config(family: str, vocab: int):
    from transformers import CONFIG_MAPPING, AutoConfig

    if family not in CONFIG_MAPPING:
        raise LookupError("unknown model_type")
    default = AutoConfig.for_model(family)
    settable = [k for k in {**SIZES, **EXPERTS} if has(default, k)
                and not isinstance(getattr(type(default), k, None), property)]  # Falcon's head_dim is computed
    overrides = {k: {**SIZES, **EXPERTS}[k] for k in settable}
    if getattr(default, "sliding_window", None):  # small enough that the probe's ~21 tokens pass it
        overrides["sliding_window"] = 8
    kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or ()))
    # Jamba's and RecurrentGemma's layer kinds follow from other fields
    derived = any(isinstance(getattr(type(default), k, None), property) for k in ("layer_types", "layers_block_type"))
    if len(kinds) > 1 and not derived:  # one layer of each kind (sliding and full, say), not the first 2 of the default
        overrides["layer_types"] = kinds[:2]
    if hasattr(default, "vocab_size_per_layer_input"):  # Gemma 3n's per-layer embeddings: 262144 rows by default
        overrides["vocab_size_per_layer_input"] = vocab
    overrides.update(ALWAYS, vocab_size=vocab, **OVERRIDES.get(family, {}))
    return AutoConfig.for_model(family, **overrides)


def non_delegated_ops(program, method: str = "forward") -> list[str]:
    """Kernels a method calls outside delegates (as in tests/test_llm.py)."""
    (plan,) = [p for p in program.execution_plan if p.name == method]
    return [op.name for op in plan.operators]


def probe(family: str, work: Path, row: dict) -> None:
    """Fills in one family's row; row["stage"] names the step running (where an exception came from)."""
    import torch
    from executorch.exir._serialize._program import deserialize_pte_binary
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions
    from executorch_mlx.llm.model_folders import BOS, EOS
    from executorch_mlx.llm.run.runner import LLMRunner

    row["stage"] = "config"
    folder = work / family
    tok = tokenizer()
    cfg = config(family, tok.get_vocab_size())
    row["stage"] = "model"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # a matrix initialised to zeros (AFMoE's router: every expert ties) gets random values
        for weight in model.parameters():
            if weight.dim() >= 2 and not weight.any():
                weight.normal_(0, cfg.initializer_range)
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS).save_pretrained(folder)

    row["stage"] = "export"
    start = time.perf_counter()
    pte = export_llm(folder, folder / "p.pte", ExportOptions(max_context=64), progress=None)
    row["export_s"] = round(time.perf_counter() - start, 1)

    row["stage"] = "count"
    program = deserialize_pte_binary(pte.read_bytes())
    program = getattr(program, "program", program)
    row["delegates"] = sum(len(plan.delegates) for plan in program.execution_plan)
    row["ops_outside"] = non_delegated_ops(program)

    row["stage"] = "generate"
    runner = LLMRunner(pte, folder)
    got = runner.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids
    ids = runner.tokenizer.encode(PROMPT).ids
    row["stage"] = "transformers"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(ids):].tolist()
    row["greedy_equal"] = got == want
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        row["note"] = f"first differs at token {at} ({len(got)} vs {len(want)} tokens)"
    del row["stage"]


def run_one(family: str, work: Path) -> dict:
    row = {"family": family}
    try:
        probe(family, work, row)
    except Exception as e:  # every failure is a result
        first = (str(e).strip().splitlines() or [""])[0].replace(f"{work}/", "")  # the folder name is enough
        if isinstance(e, LookupError) and first == "unknown model_type":
            row["note"] = first
        elif isinstance(e, NotImplementedError) and row.get("stage") == "export":
            row["note"] = f"refused: {first}"
        else:
            row["note"] = f"failed in {row.get('stage')} ({type(e).__name__}): {first}"
    return row


def run_child(family: str, work: Path, timeout: float) -> dict:
    """`--one family` in a subprocess: its last stdout line is the row."""
    cmd = [sys.executable, __file__, "--one", family, "--work", str(work)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"family": family, "note": f"hung: no result in {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        last = (done.stderr.strip().splitlines() or [""])[-1]
        return {"family": family, "note": f"crashed (exit {done.returncode}): {last}"}


def table(rows: list[dict]) -> str:
    def cell(row, key):
        value = row.get(key)
        if value is None:
            return ""
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list):
            return f"{len(value)}" + (f" ({', '.join(sorted(set(value)))})" if value else "")
        return str(value).replace("|", "\\|")

    keys = ("family", "export_s", "delegates", "ops_outside", "greedy_equal", "note")
    out = ["| family | export s | delegates | ops outside | greedy equal to transformers | note |",
           "| --- | --- | --- | --- | --- | --- |"]
    out += ["| " + " | ".join(cell(row, k) for k in keys) + " |" for row in rows]
    return "\n".join(out)


def page(rows: list[dict]) -> str:
    import transformers

    whole = sum(1 for row in rows
                if row.get("greedy_equal") and row.get("delegates") == 1 and not row.get("ops_outside"))
    unbuilt = sum(1 for row in rows if str(row.get("note", "")).startswith(("failed in config", "failed in model")))
    built = len(rows) - unbuilt
    return (f"# Decoder families\n\nWritten by `scripts/probe_families.py --write docs/families.md` (do not edit by "
            f"hand; run it again after a change) with transformers {transformers.__version__}: every decoder-only "
            f"causal-LM type it has (not its encoder-decoder types, the encoders it can run as decoders, nor the "
            f"multimodal ones, whose text models are here under their own types), each as a tiny random-weight "
            f"model (2 layers, hidden size 64, unless its row in the script says otherwise), exported at max "
            f"context 64, then {NEW_TOKENS} greedy tokens against transformers' own. Of the {built} families "
            f"transformers builds from a tiny config, {whole} ({100 * whole / max(built, 1):.0f}%) export whole "
            f"(one delegate, no op outside it) and match; the others are refused with what is missing"
            f"{f' ({unbuilt} more do not build)' if unbuilt else ''}.\n\n{table(rows)}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("families", nargs="*", default=FAMILIES)
    ap.add_argument("--timeout", type=float, default=180, help="seconds per family")
    ap.add_argument("--one", metavar="FAMILY", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--write", type=Path, metavar="FILE", help="also write the table as a markdown page")
    ap.add_argument("--rows", type=Path, metavar="LOG", help="write the page from a run's progress log (its stderr) "
                    "instead of probing, with --write")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.work)), flush=True)
        return 0
    if args.rows and not args.write:
        ap.error("--rows writes a page: give --write FILE")
    if args.rows:  # the rows a run printed, the last for each family, in the order given
        found = {}
        for line in args.rows.read_text().splitlines():
            family, _, row = line.partition(": ")
            if row.startswith("{"):
                found[family] = json.loads(row)
        args.write.write_text(page([found[f] for f in args.families if f in found]))
        return 0
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="probe-families-") as work:
        for family in args.families:
            rows.append(run_child(family, Path(work), args.timeout))
            print(f"{family}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(table(rows))
    print(f"\n{len(rows)} families in {time.perf_counter() - start:.0f} s")
    if args.write:
        args.write.write_text(page(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
